#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: WFMT=f32,f16,bf16,q8_0,q4_0,q4_1 ACCESS=texel,ssbo
// Matrix-vector product for few tokens: y[t, n] = sum_k x[t, k] * w[n, k].
// One invocation computes ROWS consecutive rows of one token (workgroup id y = token), so
// each block of x is loaded once for ROWS rows. Reduction order: quant.glsl's contract,
// shared with matmul_tiled.comp, so results are bit-identical across T and kernels.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint ROWS = 4u;

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
    uint row0 = gl_GlobalInvocationID.x * ROWS;
    uint t = gl_WorkGroupID.y;
    if (row0 >= pc.N) return;
    float acc[ROWS];
    uint wrow[ROWS];
#ifdef HAS_SCALES
    uint srow[ROWS];
#endif
    [[unroll]] for (uint r = 0u; r < ROWS; r++) {
        uint n = min(row0 + r, pc.N - 1u);  // past the last row: recompute it, never store
        acc[r] = 0.0;
        wrow[r] = n * pc.w_row;
#ifdef HAS_SCALES
        srow[r] = pc.s_base + n * pc.blocks;
#endif
    }
    for (uint b = 0u; b < pc.blocks; b++) {
        vec4 xv[8];
        load_x(t, b, pc.K, xv);
        float xsum = 0.0;
#ifdef NEEDS_XSUM
        xsum = block_sum(xv);
#endif
        [[unroll]] for (uint r = 0u; r < ROWS; r++) {
            vec4 wv[8];
            load_block(wrow[r] + b * BLOCK_TEXELS, wv);
            uint scale = 0u;
#ifdef HAS_SCALES
            scale = LD_U32(ws, srow[r] + b);
#endif
            acc[r] = combine(acc[r], block_dot(wv, xv), scale, xsum);
        }
    }
    [[unroll]] for (uint r = 0u; r < ROWS; r++) {
        if (row0 + r < pc.N) y[t * pc.N + row0 + r] = acc[r];
    }
}
