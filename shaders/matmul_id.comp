#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: WFMT=f32,f16,bf16,q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_xs,mxfp4 ACCESS=texel,ssbo
// Expert matmul (moe_matmul, ggml's mul_mat_vec_id): for each pair p = t * k + j of a token
// t and its j-th chosen expert e = ids[p], y[p, n] = sum_c x_p[c] * w[e, n, c], where x_p is
// x[t] (x [T, K]: gate/up, every expert of a token reads its row) or x[p] (x [T, k, K]:
// down, one row per pair). The stacked weight [E, N, K] holds E matrices one after another,
// each in matmul_vec's row-tiled device layout (layouts.py), so expert e's quants start
// e * expert_texels texels in and its scales e * expert_words words in.
// Work split (spec constant BY_EXPERT), one invocation per ROWS rows either way:
// - pairs (decode): workgroup y = pair p; the invocation reads ids[p] and reduces its rows.
// - by expert (prefill): workgroup y = expert e; the invocation walks the pairs in order,
//   takes those routed to e TOKENS at a time and reduces them together, each weight block
//   decoded once for all of them (an expert nobody chose only scans the ids).
// Every output is reduced by quant.glsl's helpers in its fixed block order, as matmul_vec
// reduces it, so a pair's result does not depend on the mode, on TOKENS or on which other
// tokens chose the same expert (batch invariance, ARCHITECTURE.md invariant 9).
// GATES = 2 (moe_matmul_gated): each expert's matrix stacks N gate rows over N up rows; an
// invocation reduces its ROWS gate rows and the matching ROWS up rows of the pair's expert
// exactly as the plain mode does and writes act(g) * u, with matmul_vec's gated epilogue
// (GELU: include/gelu.glsl), so it is bit-identical to moe_matmul then silu_and_mul.
#include "access.glsl"
#include "gelu.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint ROWS = 8u;
layout(constant_id = 3) const uint TOKENS = 1u;  // pairs per pass (BY_EXPERT), else 1
layout(constant_id = 4) const uint GATES = 1u;  // weight rows per output row: 1 or 2 (gated)
layout(constant_id = 5) const bool BY_EXPERT = false;
layout(constant_id = 10) const bool GELU = false;  // the gated activation: gelu_tanh, else silu
const uint WROWS = ROWS * GATES;

#ifdef WFMT_F32
IN_F32X4(0, wq);
#else
IN_U32X4(0, wq);
#endif
IN_F32(1, x);
OUT_F32(2, y);
IN_I32(3, ids);  // [T, k] expert of each pair
#if defined(WFMT_Q5_0) || defined(WFMT_Q5_1) || defined(WFMT_IQ4_XS)
#define HAS_SCALES
IN_U32X2(4, ws);
#elif defined(WFMT_Q8_0) || defined(WFMT_Q4_0) || defined(WFMT_Q4_1) || defined(WFMT_IQ4_NL) || defined(WFMT_Q6_K) || \
    defined(WFMT_Q2_K) || defined(WFMT_MXFP4)
#define HAS_SCALES
IN_U32(4, ws);
#endif

// T tokens of k pairs; N output rows (GATES * N weight rows) and K columns per expert
// (blocks of 32 values, w_row quants texels per row, s_base the scales' first word in
// expert 0); expert_texels / expert_words: one expert's device image in texels / words;
// x_per_pair: x is [T, k, K].
layout(push_constant) uniform Push {
    uint T; uint k; uint E; uint N; uint K; uint blocks; uint w_row; uint s_base;
    uint expert_texels; uint expert_words; uint x_per_pair;
} pc;

#define MATMUL_IO
#include "quant.glsl"

uint expert_of(uint p) { return min(uint(max(LD_I32(ids, p), 0)), pc.E - 1u); }

void main() {
    uint row0 = gl_GlobalInvocationID.x * ROWS;
    if (row0 >= pc.N) return;
    uint p = BY_EXPERT ? 0u : gl_WorkGroupID.y;
    uint end = BY_EXPERT ? pc.T * pc.k : p + 1u;
    uint e = BY_EXPERT ? gl_WorkGroupID.y : expert_of(p);
    uint wrow[WROWS];
    uvec2 srow[WROWS];
    [[unroll]] for (uint r = 0u; r < WROWS; r++) {
        // Gate (or plain) rows first, then the up rows N further on; past the last row:
        // recompute, never store.
        uint n = min(row0 + r % ROWS, pc.N - 1u) + (r / ROWS) * pc.N;
        wrow[r] = e * pc.expert_texels + row_base(n, pc.w_row);
        srow[r] = row_scales(n, e * pc.expert_words + pc.s_base, pc.blocks, GATES * pc.N);
    }
    while (p < end) {
        uint sel[TOKENS];
        uint count = 0u;
        for (; p < end && count < TOKENS; p++) {
            if (expert_of(p) != e) continue;
            [[unroll]] for (uint i = 0u; i < TOKENS; i++) if (i == count) sel[i] = p;
            count++;
        }
        if (count == 0u) break;
        uint xrow[TOKENS];
        [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) {
            if (tt >= count) sel[tt] = sel[0];  // padding: recompute the first, never store
            xrow[tt] = pc.x_per_pair != 0u ? sel[tt] : sel[tt] / pc.k;
        }
        float acc[WROWS * TOKENS];
        [[unroll]] for (uint i = 0u; i < WROWS * TOKENS; i++) acc[i] = 0.0;
        for (uint b = 0u; b < pc.blocks; b++) {
            vec4 xv[TOKENS][8];
            PART_T xsum[TOKENS];
            [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) {
                load_x(xrow[tt], b, pc.K, xv[tt]);
                xsum[tt] = PART_T(0.0);
#ifdef NEEDS_XSUM
                xsum[tt] = block_xsum(xv[tt]);
#endif
            }
            [[unroll]] for (uint r = 0u; r < WROWS; r++) {
                SCALE_T scale = load_scale(srow[r], b);  // before the quants: see matmul_vec.comp
                vec4 wv[8];
                load_wblock(wrow[r], b, scale, wv);
                [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) {
                    uint i = tt * WROWS + r;
                    acc[i] = combine(acc[i], block_part(wv, xv[tt]), scale, xsum[tt]);
                }
            }
        }
        [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) {
            [[unroll]] for (uint r = 0u; r < ROWS; r++) {
                if (tt < count && row0 + r < pc.N) {
                    float g = acc[tt * WROWS + r];
                    if (GATES == 2u) {
                        float u = acc[tt * WROWS + ROWS + r];
                        // elementwise.comp's expressions, as matmul_vec's epilogue: gelu.glsl's
                        // `precise` one, and silu verbatim (no product feeds a sum: nothing
                        // a compiler could contract).
                        if (GELU) {
                            g = gelu_tanh_mul(g, u);
                        } else {
                            g = g / (1.0 + exp(-g)) * u;
                        }
                    }
                    y[sel[tt] * pc.N + row0 + r] = g;
                }
            }
        }
    }
}
