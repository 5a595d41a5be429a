// Attention with an online softmax in registers: the one definition of the per-position
// score, the running-state update, the lanes' merge and the chunks' merge that
// paged_attention.comp and paged_attention_gqa.comp both call, so a row's rounding is the
// same in every kernel that computes it (a decode row gets the same bits in a decode-only step
// and beside a prefill, split over chunks or not). `precise` keeps every product and sum
// rounded as written: a compiler may otherwise fuse a * b + c into an fma in one kernel's
// context and not in another's.
//
// The including shader declares, before including this file:
//   HD4 (head_dim / 4), SOFTCAP (0 = off; c > 0 caps scores at c * tanh(s / c), and the
//   shader includes softcap.glsl) and CHUNK (positions per chunk, 0 = one), all constants
//   (SINKS, whether a row's state takes its head's attention sink, is the shader's own);
//   ATTENTION_ROWS: rows of state per invocation (1, or the GQA kernel's query heads x tokens);
//   vec4 k_row[HD4], v_row[HD4]: the key and value row of the position being folded;
//   include/kv_cache.glsl (the cache bindings and LOAD_ROW);
//   the bindings q (read with LD_F32X4) and o (vec4s); GL_EXT_control_flow_attributes;
//   ATTENTION_SUBGROUP for the subgroup merge (subgroup arithmetic enabled); ATTENTION_PAGED
//   for the paged walk's helpers (the binding positions, and pc.window, pc.block_size,
//   pc.max_blocks). Positions are folded in the order the shader visits them; that order
//   alone fixes the rounding, so a row's output does not depend on what else shares the
//   dispatch (batch invariance).

#include "chunk_merge.glsl"

vec4 q_reg[ATTENTION_ROWS * HD4];  // per row: the query, pre-scaled by attention_prescale()
vec4 acc[ATTENTION_ROWS * HD4];    // per row: sum over positions of exp2(score - run_max) * v
float run_max[ATTENTION_ROWS];     // per row: the largest score so far
float run_sum[ATTENTION_ROWS];     // per row: sum over positions of exp2(score - run_max)
// Per row, the chunks folded so far (a kernel that walks a row's chunks itself): the same
// three parts, merged in chunk order by merge_weights().
vec4 merged_acc[ATTENTION_ROWS * HD4];
float merged_max[ATTENTION_ROWS];
float merged_sum[ATTENTION_ROWS];

// q's pre-scale: into the exp2 domain at once (scale * log2 e), unless scores are capped
// first (then by scale alone, and each capped score is moved into the exp2 domain).
float attention_prescale(float scale) { return SOFTCAP > 0.0 ? scale : scale * LOG2E; }

// Load row r's query, q's vec4s from texel q_texel on, times q_scale (attention_prescale).
void attend_load_q(uint r, uint q_texel, float q_scale) {
    [[unroll]] for (uint d = 0u; d < HD4; ++d) q_reg[r * HD4 + d] = LD_F32X4(q, q_texel + d) * q_scale;
}

// Start row r's running state over a new chunk of positions.
void attend_reset(uint r) {
    [[unroll]] for (uint d = 0u; d < HD4; ++d) acc[r * HD4 + d] = vec4(0.0);
    run_max[r] = NEG_INF;  // the first position sets it
    run_sum[r] = 0.0;
}

// score + q . k, one component at a time as fused multiply-adds: a fixed order and rounding
// that no compiler can regroup (dot() leaves its lowering to the driver).
float add_dot(float score, vec4 q, vec4 k) {
    precise float s = fma(q.x, k.x, score);
    s = fma(q.y, k.y, s);
    s = fma(q.z, k.z, s);
    s = fma(q.w, k.w, s);
    return s;
}

// Fold into every row the position whose key and value rows start at cache texel `texel`
// (LOAD_ROW, include/kv_cache.glsl). The head_dim loops run outermost: each key texel serves
// every row's score while it is in registers, and the value row is loaded once the weights
// are known, so neither row is held across the other's work (on llvmpipe that took a third of
// the GQA loop's stack traffic). Each row's operations and their order are those of the row
// alone, so the rows' count never changes their bits. The loops over the head are unrolled:
// llvmpipe stops any loop once a shader invocation has run 65535 loop iterations in all
// (gallivm's loop limiter), and walking a long context through rolled head_dim loops reached
// that (head_dim 256 past ~3800 positions per lane), returning garbage.
// A new maximum rescales the running sums by `shrink` and weighs the position 1; otherwise
// shrink is exactly 1 and the weight exp2(score - max). So one exp2 serves both, and
// multiplying by shrink unconditionally changes no bit while sparing a divergent branch
// (llvmpipe runs both sides of one and blends every store).
// Only the rows whose bit is set in `live` take the position; the others keep their state as
// it was (selected, never scaled by 1 and added 0, which a non-finite value would change).
// With every bit set (attend_position) the selects fold away at compile time.
void attend_position_rows(uint texel, uint live) {
    LOAD_ROW(k_cache, k_row, texel);
    precise float score[ATTENTION_ROWS];
    [[unroll]] for (uint r = 0u; r < ATTENTION_ROWS; ++r) score[r] = 0.0;
    [[unroll]] for (uint d = 0u; d < HD4; ++d)
        [[unroll]] for (uint r = 0u; r < ATTENTION_ROWS; ++r) score[r] = add_dot(score[r], q_reg[r * HD4 + d], k_row[d]);
    float shrink[ATTENTION_ROWS], weight[ATTENTION_ROWS];
    bool on[ATTENTION_ROWS];
    [[unroll]] for (uint r = 0u; r < ATTENTION_ROWS; ++r) {
        on[r] = ((live >> r) & 1u) != 0u;
        if (SOFTCAP > 0.0) score[r] = softcap_f32(score[r], SOFTCAP) * LOG2E;
        float old_max = run_max[r];
        bool rises = score[r] > old_max;
        precise float e = exp2(rises ? old_max - score[r] : score[r] - old_max);
        shrink[r] = rises ? e : 1.0;
        weight[r] = rises ? 1.0 : e;
        run_max[r] = on[r] && rises ? score[r] : old_max;
        precise float sum = run_sum[r] * shrink[r] + weight[r];
        run_sum[r] = on[r] ? sum : run_sum[r];
    }
    LOAD_ROW(v_cache, v_row, texel);
    [[unroll]] for (uint d = 0u; d < HD4; ++d)
        [[unroll]] for (uint r = 0u; r < ATTENTION_ROWS; ++r) {
            precise vec4 a = fma(vec4(weight[r]), v_row[d], acc[r * HD4 + d] * shrink[r]);
            acc[r * HD4 + d] = on[r] ? a : acc[r * HD4 + d];
        }
}
void attend_position(uint texel) { attend_position_rows(texel, ~0u); }

#ifdef ATTENTION_PAGED
// Token t's context end, its window's first position (include/chunk_merge.glsl), and the
// positions [lo, hi) of chunk c of the window [first, n), empty where the window misses it.
uint context_end(uint t) { return row_end(LD_I32(positions, t), pc.max_blocks * pc.block_size); }
uint window_start(uint n) { return row_first(n, pc.window); }
uvec2 chunk_span(uint first, uint n) { return row_chunks(first, n, CHUNK); }
uvec2 chunk_range(uint first, uint n, uint c) {
    return CHUNK > 0u ? uvec2(max(first, c * CHUNK), min(n, (c + 1u) * CHUNK)) : uvec2(first, n);
}
// The cache texel where the key / value rows of the position at block b, offset off of the
// sequence's block-table row (from table_row) start; then b, off move on by `step` positions
// without a division.
uint next_texel(uint table_row, uint head_texel, inout uint b, inout uint off, uint step) {
    uint texel = (uint(LD_I32(block_table, table_row + b)) * pc.block_size + off) * pc.kv_dim4 + head_texel;
    off += step;
    while (off >= pc.block_size) { off -= pc.block_size; ++b; }
    return texel;
}
#endif

#ifdef ATTENTION_SUBGROUP
// Row r's state over all lanes of the subgroup (each folded its own positions), left in every
// lane: the maximum, and the sums rescaled to it. A lane that saw nothing (max -inf) weighs 0;
// the chunk's first position is lane 0's, so the maximum is finite. Called in uniform control
// flow.
void attend_lanes_merge(uint r) {
    float m = subgroupMax(run_max[r]);
    precise float f = run_max[r] == NEG_INF ? 0.0 : exp2(run_max[r] - m);
    precise float lane_sum = run_sum[r] * f;
    run_sum[r] = subgroupAdd(lane_sum);
    run_max[r] = m;
    [[unroll]] for (uint d = 0u; d < HD4; ++d) {
        precise vec4 lane_acc = acc[r * HD4 + d] * f;
        acc[r * HD4 + d] = subgroupAdd(lane_acc);
    }
}
bool attend_leader() { return gl_SubgroupInvocationID == 0u; }
#else
void attend_lanes_merge(uint r) {}  // one invocation folded every position
bool attend_leader() { return true; }
#endif

// Row r's (merged) chunk state as a partial at o[out_row ..]: (max, sum, 0, 0), then the
// unnormalised weighted values, for paged_attention_merge.comp.
void attend_store_partial(uint r, uint out_row) {
    if (!attend_leader()) return;
    o[out_row] = vec4(run_max[r], run_sum[r], 0.0, 0.0);
    [[unroll]] for (uint d = 0u; d < HD4; ++d) o[out_row + 1u + d] = acc[r * HD4 + d];
}

// The chunks a row's walk folds itself: start with none, fold the current chunk's state, and
// store the normalised result at o[out_row ..].
void merged_reset(uint r) {
    [[unroll]] for (uint d = 0u; d < HD4; ++d) merged_acc[r * HD4 + d] = vec4(0.0);
    merged_max[r] = NEG_INF;
    merged_sum[r] = 0.0;
}
void merge_chunk(uint r) {
    if (merged_max[r] == NEG_INF) {  // the first chunk
        merged_max[r] = run_max[r];
        merged_sum[r] = run_sum[r];
        [[unroll]] for (uint d = 0u; d < HD4; ++d) merged_acc[r * HD4 + d] = acc[r * HD4 + d];
        return;
    }
    vec2 w = merge_weights(merged_max[r], run_max[r]);
    precise float sum = merged_sum[r] * w.x + run_sum[r] * w.y;
    merged_sum[r] = sum;
    merged_max[r] = max(merged_max[r], run_max[r]);
    [[unroll]] for (uint d = 0u; d < HD4; ++d) {
        precise vec4 a = merged_acc[r * HD4 + d] * w.x + acc[r * HD4 + d] * w.y;
        merged_acc[r * HD4 + d] = a;
    }
}
// Row r's attention sink (a logit, not scaled: transformers concatenates it to the scaled
// scores) into its merged state, after its last chunk.
void merge_sink(uint r, float sink_logit) {
    vec2 w = sink_merge(merged_max[r], merged_sum[r], sink_logit);
    merged_sum[r] = w.y;
    [[unroll]] for (uint d = 0u; d < HD4; ++d) {
        precise vec4 a = merged_acc[r * HD4 + d] * w.x;
        merged_acc[r * HD4 + d] = a;
    }
}
void attend_store_merged(uint r, uint out_row) {
    if (!attend_leader()) return;
    precise float inv_sum = 1.0 / merged_sum[r];
    [[unroll]] for (uint d = 0u; d < HD4; ++d) {
        precise vec4 normalised = merged_acc[r * HD4 + d] * inv_sum;
        o[out_row + d] = normalised;
    }
}
