// Workgroup reductions for the row kernels (norm, sample, qkv_rope's QK-norm): one row per
// workgroup, lane l accumulates columns l, l + W, l + 2W, ... in order, then the W partials
// combine in a fixed tree (l with l + s for s = W/2, ..., 1). The order depends only on W, a
// per-device specialisation constant, never on how many rows are in flight: batch invariance
// (ARCHITECTURE.md invariant 9). W must be a power of two. Every lane of the workgroup must call these
// (they contain barriers), so callers only return early for a whole workgroup.
// ROW_LANES repeats spec constant 0 (the workgroup size, DECLARE_LOCAL_SIZE) because glslang
// sizes an array declared with gl_WorkGroupSize.x from its default, 1; llama.cpp does the same.
layout(constant_id = 0) const uint ROW_LANES = 1;
shared float reduce_scratch[ROW_LANES];
shared uint reduce_index[ROW_LANES];

float workgroup_sum(float v) {
    if (ROW_LANES == 1u) return v;  // folded away at specialisation
    uint l = gl_LocalInvocationID.x;
    reduce_scratch[l] = v;
    barrier();
    for (uint s = ROW_LANES / 2u; s > 0u; s >>= 1u) {
        if (l < s) reduce_scratch[l] += reduce_scratch[l + s];
        barrier();
    }
    float total = reduce_scratch[0];
    barrier();  // the next reduction overwrites the scratch
    return total;
}

float workgroup_max(float v) {
    if (ROW_LANES == 1u) return v;
    uint l = gl_LocalInvocationID.x;
    reduce_scratch[l] = v;
    barrier();
    for (uint s = ROW_LANES / 2u; s > 0u; s >>= 1u) {
        if (l < s) reduce_scratch[l] = max(reduce_scratch[l], reduce_scratch[l + s]);
        barrier();
    }
    float total = reduce_scratch[0];
    barrier();
    return total;
}

// True when (v, i) beats (best, best_i) under numpy's argmax: larger wins, NaN beats any
// number, and on ties (or two NaNs) the smaller index wins.
bool argmax_beats(float v, uint i, float best, uint best_i) {
    bool v_nan = isnan(v), b_nan = isnan(best);
    if (v_nan != b_nan) return v_nan;
    if (!v_nan && v != best) return v > best;
    return i < best_i;
}

// The index of the workgroup's best (value, index) pair.
uint workgroup_argmax(float v, uint i) {
    if (ROW_LANES == 1u) return i;
    uint l = gl_LocalInvocationID.x;
    reduce_scratch[l] = v;
    reduce_index[l] = i;
    barrier();
    for (uint s = ROW_LANES / 2u; s > 0u; s >>= 1u) {
        if (l < s && argmax_beats(reduce_scratch[l + s], reduce_index[l + s],
                                  reduce_scratch[l], reduce_index[l])) {
            reduce_scratch[l] = reduce_scratch[l + s];
            reduce_index[l] = reduce_index[l + s];
        }
        barrier();
    }
    uint best = reduce_index[0];
    barrier();
    return best;
}
