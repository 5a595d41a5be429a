// Attention with an online softmax in registers: the one definition of the per-position
// score, the running-state update and the lanes' merge that paged_attention.comp,
// paged_prefill.comp and attention.comp all call, so a row's rounding is the same in every
// kernel that computes it (a decode row gets the same bits in a decode-only step and in a
// step the tiled prefill kernel runs). `precise` keeps every product and sum rounded as
// written: a compiler may otherwise fuse a * b + c into an fma in one kernel's context and
// not in another's.
//
// The including shader declares, before including this file:
//   HD4 (head_dim / 4) and SOFTCAP (0 = off; c > 0 caps scores at c * tanh(s / c), and the
//   shader includes softcap.glsl), both constants;
//   ATTENTION_ROWS: rows of state per invocation (1, or the tiled kernel's tile);
//   KEY(kv_row, d), VALUE(kv_row, d): the vec4 d of the key / value row at texel kv_row;
//   the bindings q (read with LD_F32X4) and o (vec4s); GL_EXT_control_flow_attributes;
//   ATTENTION_SUBGROUP for the subgroup
//   merge (subgroup arithmetic enabled); ATTENTION_PAGED for the paged walk's helpers (the
//   bindings positions, and pc.window, pc.block_size, pc.max_blocks). Positions are folded in the order the shader visits them; that
//   order alone fixes the rounding, so a row's output does not depend on what else shares
//   the dispatch (batch invariance).

const float LOG2E = 1.4426950408889634;
#define NEG_INF uintBitsToFloat(0xFF800000u)

vec4 q_reg[ATTENTION_ROWS * HD4];  // per row: the query, pre-scaled by attention_prescale()
vec4 acc[ATTENTION_ROWS * HD4];    // per row: sum over positions of exp2(score - run_max) * v
float run_max[ATTENTION_ROWS];     // per row: the largest score so far
float run_sum[ATTENTION_ROWS];     // per row: sum over positions of exp2(score - run_max)

// q's pre-scale: into the exp2 domain at once (scale * log2 e), unless scores are capped
// first (then by scale alone, and each capped score is moved into the exp2 domain).
float attention_prescale(float scale) { return SOFTCAP > 0.0 ? scale : scale * LOG2E; }

// Reset row r's running state and load its query, q's vec4s from texel q_texel on, times
// q_scale (attention_prescale).
void attend_begin(uint r, uint q_texel, float q_scale) {
    for (uint d = 0u; d < HD4; ++d) q_reg[r * HD4 + d] = LD_F32X4(q, q_texel + d) * q_scale;
    for (uint d = 0u; d < HD4; ++d) acc[r * HD4 + d] = vec4(0.0);
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

// Fold into row r the position whose key and value rows start at texel kv_row. The loops over
// the head are unrolled: llvmpipe stops any loop once a shader invocation has run 65535 loop
// iterations in all (gallivm's loop limiter), and walking a long context through rolled
// head_dim loops reached that (head_dim 256 past ~3800 positions per lane), returning garbage.
void attend_position(uint r, uint kv_row) {
    uint base = r * HD4;
    precise float score = 0.0;
    [[unroll]] for (uint d = 0u; d < HD4; ++d) score = add_dot(score, q_reg[base + d], KEY(kv_row, d));
    if (SOFTCAP > 0.0) score = softcap_f32(score, SOFTCAP) * LOG2E;
    if (score > run_max[r]) {  // rescale the running sums to the new maximum
        precise float shrink = exp2(run_max[r] - score);
        precise float shrunk = run_sum[r] * shrink;
        run_sum[r] = shrunk;
        [[unroll]] for (uint d = 0u; d < HD4; ++d) {
            precise vec4 a = acc[base + d] * shrink;
            acc[base + d] = a;
        }
        run_max[r] = score;
    }
    precise float weight = exp2(score - run_max[r]);
    precise float sum = run_sum[r] + weight;
    run_sum[r] = sum;
    [[unroll]] for (uint d = 0u; d < HD4; ++d) {
        precise vec4 a = fma(vec4(weight), VALUE(kv_row, d), acc[base + d]);
        acc[base + d] = a;
    }
}

#ifdef ATTENTION_PAGED
// The end n = positions[t] + 1 of token t's context, never past the block table whatever
// positions[t] says, and the first position its window lets it see.
uint context_end(uint t) { return min(uint(LD_I32(positions, t)) + 1u, pc.max_blocks * pc.block_size); }
uint window_start(uint n) { return pc.window > 0u && n > pc.window ? n - pc.window : 0u; }
#endif

#ifdef ATTENTION_SUBGROUP
// Row r's result over all lanes of the subgroup (each folded its own positions), stored by
// lane 0 at o[out_row ..]: normalised, or with `partial` the state (max, sum, 0, 0) and the
// unnormalised values (paged_attention_merge.comp folds those). Lane 0 saw the row's first
// position, so the maximum is finite; a lane that saw nothing (max -inf) weighs 0. Called in
// uniform control flow.
void attend_store(uint r, uint out_row, bool partial) {
    bool leader = gl_SubgroupInvocationID == 0u;
    float m = subgroupMax(run_max[r]);
    precise float f = run_max[r] == NEG_INF ? 0.0 : exp2(run_max[r] - m);
    precise float lane_sum = run_sum[r] * f;
    float sum = subgroupAdd(lane_sum);
    if (partial) {
        if (leader) o[out_row] = vec4(m, sum, 0.0, 0.0);
        out_row += 1u;
    }
    precise float inv_sum = 1.0 / sum;
    for (uint d = 0u; d < HD4; ++d) {
        precise vec4 lane_acc = acc[r * HD4 + d] * f;
        vec4 total = subgroupAdd(lane_acc);
        precise vec4 normalised = total * inv_sum;
        if (leader) o[out_row + d] = partial ? total : normalised;
    }
}
#else
// Row r's result (one invocation folded all its positions) at o[out_row ..]: normalised, or
// with `partial` the state (max, sum, 0, 0) and the unnormalised values.
void attend_store(uint r, uint out_row, bool partial) {
    if (partial) {
        o[out_row] = vec4(run_max[r], run_sum[r], 0.0, 0.0);
        for (uint d = 0u; d < HD4; ++d) o[out_row + 1u + d] = acc[r * HD4 + d];
        return;
    }
    precise float inv_sum = 1.0 / run_sum[r];
    for (uint d = 0u; d < HD4; ++d) {
        precise vec4 normalised = acc[r * HD4 + d] * inv_sum;
        o[out_row + d] = normalised;
    }
}
#endif
