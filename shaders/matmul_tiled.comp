#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: WFMT=f32,f16,bf16,q8_0,q4_0,q4_1 ACCESS=texel,ssbo
// Register-tiled matmul for prefill: y[t, n] = sum_k x[t, k] * w[n, k].
// One invocation computes TILE_TOKENS tokens x TILE_ROWS rows (workgroup id y = token tile):
// per block it decodes its TILE_ROWS weight blocks once and reuses them for every token, so
// weights are fetched once per tile rather than once per token. No shared memory: on
// llvmpipe shared-memory loads measured ~20x slower than texel fetches (LLVMPIPE_NOTES.md).
// Reduction order: quant.glsl's contract, shared with matmul_vec.comp (bit-identical rows).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint TILE_ROWS = 4u;
layout(constant_id = 3) const uint TILE_TOKENS = 8u;

#ifdef WFMT_F32
IN_F32X4(0, wq);
#else
IN_U32X4(0, wq);
#endif
IN_F32(1, x);
OUT_F32(2, y);
#if defined(WFMT_Q8_0) || defined(WFMT_Q4_0) || defined(WFMT_Q4_1)
#define HAS_SCALES
IN_U32(3, ws);
#endif

// w_row: quants texels per weight row; s_base: index of the first scales word (u32 units).
layout(push_constant) uniform Push { uint T; uint N; uint K; uint blocks; uint w_row; uint s_base; } pc;

#define MATMUL_IO
#include "quant.glsl"

void main() {
    uint row0 = gl_GlobalInvocationID.x * TILE_ROWS;
    uint t0 = gl_WorkGroupID.y * TILE_TOKENS;
    if (row0 >= pc.N) return;
    float acc[TILE_TOKENS * TILE_ROWS];
    uint wrow[TILE_ROWS];
#ifdef HAS_SCALES
    uint srow[TILE_ROWS];
#endif
    [[unroll]] for (uint r = 0u; r < TILE_ROWS; r++) {
        uint n = min(row0 + r, pc.N - 1u);  // past the last row/token: recompute, never store
        wrow[r] = n * pc.w_row;
#ifdef HAS_SCALES
        srow[r] = pc.s_base + n * pc.blocks;
#endif
    }
    [[unroll]] for (uint i = 0u; i < TILE_TOKENS * TILE_ROWS; i++) acc[i] = 0.0;
    for (uint b = 0u; b < pc.blocks; b++) {
        vec4 wv[TILE_ROWS][8];
        uint scale[TILE_ROWS];
        [[unroll]] for (uint r = 0u; r < TILE_ROWS; r++) {
            load_block(wrow[r] + b * BLOCK_TEXELS, wv[r]);
            scale[r] = 0u;
#ifdef HAS_SCALES
            scale[r] = LD_U32(ws, srow[r] + b);
#endif
        }
        [[unroll]] for (uint tt = 0u; tt < TILE_TOKENS; tt++) {
            vec4 xv[8];
            load_x(min(t0 + tt, pc.T - 1u), b, pc.K, xv);
            float xsum = 0.0;
#ifdef NEEDS_XSUM
            xsum = block_sum(xv);
#endif
            [[unroll]] for (uint r = 0u; r < TILE_ROWS; r++) {
                uint i = tt * TILE_ROWS + r;
                acc[i] = combine(acc[i], block_dot(wv[r], xv), scale[r], xsum);
            }
        }
    }
    [[unroll]] for (uint tt = 0u; tt < TILE_TOKENS; tt++) {
        [[unroll]] for (uint r = 0u; r < TILE_ROWS; r++) {
            if (t0 + tt < pc.T && row0 + r < pc.N) y[(t0 + tt) * pc.N + row0 + r] = acc[tt * TILE_ROWS + r];
        }
    }
}
