#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: WFMT=f32,f16,bf16,q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_xs,mxfp4 EPILOGUE=plain,qkv ACCESS=texel,ssbo
// Matmul y[t, n] = sum_k x[t, k] * w[n, k] for decode and prefill alike.
// One invocation computes ROWS consecutive rows x TOKENS consecutive tokens (workgroup id
// y = token tile). Per 32-value block it first loads the block's activations of its TOKENS
// tokens, then streams its ROWS weight rows: each weight block is fetched and decoded once
// and reused for every token, each activation block once for every row. (Measured on
// llvmpipe: 20-30% faster than holding ROWS decoded weight blocks and streaming tokens,
// and a TOKENS-token pass costs far less than TOKENS one-token passes.)
// Reduction order: quant.glsl's contract, so results are bit-identical across T, ROWS,
// TOKENS and workgroup size (ARCHITECTURE.md invariant 9).
// GATES = 2 (matmul_silu_and_mul): w stacks N gate rows over N up rows; an invocation
// reduces its ROWS gate rows and the matching ROWS up rows exactly as the plain matmul does
// (so g and u are bit-identical to its outputs) and writes y[t, n] = silu(g) * u in
// elementwise.comp's silu_mul expression, bit-identical to matmul then silu_and_mul.
// FUSE (spec constant 6; bits FUSE_RMS, FUSE_ADD) picks the fused prologue and epilogue over
// bindings every plain module declares (the host binds x where one is unused), so one module
// per format and access path serves all four, as matmul_tiled.comp's FUSE does:
// FUSE_RMS (rms_norm_matmul): x is the un-normalised residual stream. The same single pass
// over x also sums each token's x^2 (in block order, so batch invariant), the blocks are
// multiplied by the norm weight g as they load, and the finished sums are scaled by
// 1 / sqrt(mean(x^2) + eps): y = inv * sum(w * (x * g)), where the unfused pair computes
// sum(w * ((x * inv) * g)). Equal up to f32 rounding (the bound is in the parity test).
// GELU (spec constant 10) makes the gate gelu_tanh (GeGLU, matmul_gelu_tanh_and_mul), in
// elementwise.comp's gelu_mul expression, bit-identical to matmul then gelu_tanh_and_mul.
// OUT_SCALE (spec constant 11, float bits; Granite's residual multiplier): y = (x @ w.T) *
// scale, one rounded product as the scale op, before FUSE_ADD's add.
// FUSE_ADD (matmul_add): y = x @ w.T + residual, the residual add of a block's output
// projection, bit-identical to matmul then add. BIAS (spec constant 12): the residual is one
// row [N] broadcast over the tokens, a projection's bias (Qwen2's q/k/v).
// FUSE_RMS | FUSE_ADD (rms_norm_matmul_add): FUSE_RMS's prologue and FUSE_ADD's epilogue,
// e.g. a normed q/k/v projection plus its bias; bit-identical to rms_norm_matmul then add.
// EPILOGUE=qkv (rms_norm_qkv_rope_kv_write), a variant because its bindings and push
// constants are its own: FUSE_RMS's prologue, the stacked qkv projection, then
// include/qkv_epilogue.glsl (rope, q out, k and v into an f32 or f16 cache: spec constant
// KV_F16, so both caches share one module per format).
#include "access.glsl"
#include "gelu.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint ROWS = 8u;
layout(constant_id = 3) const uint TOKENS = 1u;
layout(constant_id = 4) const uint GATES = 1u;  // weight rows per output row: 1 or 2 (gated)
layout(constant_id = 10) const bool GELU = false;  // the gated activation: gelu_tanh, else silu
layout(constant_id = 11) const float OUT_SCALE = 1.0;
const uint FUSE_NONE = 0u, FUSE_RMS = 1u, FUSE_ADD = 2u;  // bits of FUSE, as matmul_tiled.comp's
#ifdef EPILOGUE_QKV
const uint FUSE = FUSE_RMS;  // the qkv epilogue always follows the folded norm
#else
layout(constant_id = 6) const uint FUSE = FUSE_NONE;
#endif
const bool RMS = (FUSE & FUSE_RMS) != 0u;
const bool ADD = (FUSE & FUSE_ADD) != 0u;
const uint WROWS = ROWS * GATES;
// SPLIT > 1 (GPUs): split-K. The workgroup is SPLIT lanes sharing one set of ROWS rows x
// TOKENS tokens; lane j folds blocks j, j + SPLIT, ... in order (each in quant.glsl's block
// order), then the lanes' partial sums are added in shared memory by a fixed halving tree
// and lane 0 runs the epilogue. The order depends only on SPLIT, which the host picks per
// device and K, never per T: decode and prefill stay bit-identical (batch invariance).
// SPLIT = 1 (CPU devices): one invocation walks all blocks; the rows spread over invocations.
layout(constant_id = 8) const uint SPLIT = 1u;  // a power of two
const uint NSUM = WROWS * TOKENS + (RMS ? 4u * TOKENS : 0u);  // the accumulators, then FUSE_RMS's x^2 sums
shared float partial[SPLIT * NSUM];

#ifdef WFMT_F32
IN_F32X4(0, wq);
#else
IN_U32X4(0, wq);
#endif
IN_F32(1, x);
OUT_F32(2, y);
#if defined(WFMT_Q5_0) || defined(WFMT_Q5_1) || defined(WFMT_IQ4_XS)
#define HAS_SCALES
IN_U32X2(3, ws);  // (d or d|m, fifth bits) per block; iq4_xs: its scales per super-block
#elif defined(WFMT_Q8_0) || defined(WFMT_Q4_0) || defined(WFMT_Q4_1) || defined(WFMT_IQ4_NL) || defined(WFMT_Q6_K) || \
    defined(WFMT_Q2_K) || defined(WFMT_MXFP4)
#define HAS_SCALES
IN_U32(3, ws);  // the scales word per block; q6_k: f16 d, q2_k: f16 d | dmin per super-block
#endif
IN_F32(4, norm_w);  // FUSE_RMS: the norm weight [K]
#ifdef EPILOGUE_QKV
IN_I32(5, positions);
IN_F32(6, cos_sin);
layout(constant_id = 9) const bool KV_F16 = false;  // the cache holds f16 pairs, else f32 bits
OUT_U32(7, k_cache);
OUT_U32(8, v_cache);
IN_I32(9, slots);
#else
IN_F32(5, residual);  // FUSE_ADD: [T, N], or [N] with BIAS
layout(constant_id = 12) const bool BIAS = false;  // the residual is one row [N] for every token
#endif

// N: output rows (the weight has GATES * N); w_row: quants texels per weight row; s_base: index of the first scales word (u32 units).
// eps: FUSE_RMS's epsilon (unused otherwise).
#ifdef EPILOGUE_QKV
// H, KVH: q and kv heads of D dims; rot: rotated dims per head; max_pos: rows of cos_sin.
layout(push_constant) uniform Push {
    uint T; uint N; uint K; uint blocks; uint w_row; uint s_base; float eps;
    uint H; uint KVH; uint D; uint rot; uint max_pos; uint interleaved;
} pc;
#include "qkv_epilogue.glsl"
#else
layout(push_constant) uniform Push { uint T; uint N; uint K; uint blocks; uint w_row; uint s_base; float eps; } pc;
#endif

#define MATMUL_IO
#define MATMUL_NORM_W
#include "quant.glsl"

void main() {
    uint lane = SPLIT > 1u ? gl_LocalInvocationID.x : 0u;
    uint row0 = (SPLIT > 1u ? gl_WorkGroupID.x : gl_GlobalInvocationID.x) * ROWS;
    uint t0 = gl_WorkGroupID.y * TOKENS;
    if (row0 >= pc.N) return;  // with SPLIT > 1, the whole workgroup together
    float acc[WROWS * TOKENS];
    uint wrow[WROWS];
    uvec2 srow[WROWS];
    [[unroll]] for (uint r = 0u; r < WROWS; r++) {
        // Weight row: gate (or plain) rows first, then the up rows N further on. Past the
        // last row/token: recompute, never store.
        uint n = min(row0 + r % ROWS, pc.N - 1u) + (r / ROWS) * pc.N;
#ifdef EPILOGUE_QKV
        n = qkv_row(row0 + r);  // ROWS = 8 rows closed under rotation partners (N % 8 == 0)
#endif
        wrow[r] = row_base(n, pc.w_row);
        srow[r] = row_scales(n, pc.s_base, pc.blocks, GATES * pc.N);
    }
    [[unroll]] for (uint i = 0u; i < WROWS * TOKENS; i++) acc[i] = 0.0;
    vec4 sq[TOKENS];  // FUSE_RMS: per token, four running sums of x^2 (one per vec4 component)
    [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) sq[tt] = vec4(0.0);
    for (uint b = lane; b < pc.blocks; b += SPLIT) {
        vec4 xv[TOKENS][8];
        PART_T xsum[TOKENS];
        vec4 gv[8];
        if (RMS) load_norm_weight(b, pc.K, gv);
        [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) {
            load_x(min(t0 + tt, pc.T - 1u), b, pc.K, xv[tt]);
            if (RMS) {
                [[unroll]] for (uint j = 0u; j < 8u; j++) {
                    precise vec4 s = fma(xv[tt][j], xv[tt][j], sq[tt]);
                    sq[tt] = s;
                    xv[tt][j] *= gv[j];
                }
            }
            xsum[tt] = PART_T(0.0);
#ifdef NEEDS_XSUM
            xsum[tt] = block_xsum(xv[tt]);
#endif
        }
        [[unroll]] for (uint r = 0u; r < WROWS; r++) {
            // Scale first: when the texel path's loads were calls on llvmpipe (texelFetch), one
            // between the decode and the dots spilled all 32 weights; imageLoad is inline.
            SCALE_T scale = load_scale(srow[r], b);
            vec4 wv[8];
            load_wblock(wrow[r], b, scale, wv);
            // The tokens' dots advance together, a vec4 at a time (block_part_step: block_part's
            // order, bit for bit), not one whole block_part per token: with TOKENS > 1 llvmpipe
            // then spills fewer of the decoded weights between the tokens' passes (T = 4,
            // SmolLM2 shapes: 2-20% less device time, T = 1 the same machine code;
            // docs/BENCHMARKS.md).
            PART_T p[TOKENS];
            [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) p[tt] = PART_T(0.0);
            [[unroll]] for (uint j = 0u; j < 8u; j++) {
                [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) p[tt] = block_part_step(p[tt], j, wv[j], xv[tt][j]);
            }
            [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) {
                uint i = tt * WROWS + r;
                acc[i] = combine(acc[i], p[tt], scale, xsum[tt]);
            }
        }
    }
    if (SPLIT > 1u) {
        uint base = lane * NSUM;
        [[unroll]] for (uint i = 0u; i < WROWS * TOKENS; i++) partial[base + i] = acc[i];
        if (RMS) {
            [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++)
                [[unroll]] for (uint c = 0u; c < 4u; c++) partial[base + WROWS * TOKENS + 4u * tt + c] = sq[tt][c];
        }
        memoryBarrierShared();
        barrier();
        for (uint half_ = SPLIT / 2u; half_ > 0u; half_ /= 2u) {
            if (lane < half_) {
                for (uint i = 0u; i < NSUM; i++) {
                    precise float v = partial[base + i] + partial[base + half_ * NSUM + i];
                    partial[base + i] = v;
                }
            }
            memoryBarrierShared();
            barrier();
        }
        if (lane != 0u) return;
        [[unroll]] for (uint i = 0u; i < WROWS * TOKENS; i++) acc[i] = partial[i];
        if (RMS) {
            [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++)
                sq[tt] = vec4(partial[WROWS * TOKENS + 4u * tt], partial[WROWS * TOKENS + 4u * tt + 1u],
                              partial[WROWS * TOKENS + 4u * tt + 2u], partial[WROWS * TOKENS + 4u * tt + 3u]);
        }
    }
    [[unroll]] for (uint tt = 0u; tt < TOKENS; tt++) {
        float inv = 1.0;
        if (RMS) {
            precise vec2 s2 = sq[tt].xy + sq[tt].zw;
            precise float rms_inv = 1.0 / sqrt((s2.x + s2.y) / float(pc.K) + pc.eps);
            inv = rms_inv;
        }
#ifdef EPILOGUE_QKV
        if (t0 + tt < pc.T) {
            float v[8];
            [[unroll]] for (uint r = 0u; r < 8u; r++) v[r] = acc[tt * WROWS + r] * inv;
            qkv_epilogue(t0 + tt, row0, v);
        }
#else
        [[unroll]] for (uint r = 0u; r < ROWS; r++) {
            if (t0 + tt < pc.T && row0 + r < pc.N) {
                float g = acc[tt * WROWS + r] * inv;
                if (GATES == 2u) {
                    float u = acc[tt * WROWS + ROWS + r] * inv;
                    if (GELU) {
                        g = gelu_tanh_mul(g, u);  // include/gelu.glsl, as elementwise.comp's gelu_mul
                    } else {
                        g = g / (1.0 + exp(-g)) * u;  // elementwise.comp's silu_mul, verbatim
                    }
                }
                if (OUT_SCALE != 1.0) {
                    precise float scaled = g * OUT_SCALE;
                    g = scaled;
                }
                if (ADD) {
                    // precise: the add of the rounded output, as the add op sees it (never an
                    // fma of acc * inv + residual, which FUSE_RMS | FUSE_ADD's compile might
                    // contract).
                    precise float sum = g + LD_F32(residual, (BIAS ? 0u : (t0 + tt) * pc.N) + row0 + r);
                    g = sum;
                }
                y[(t0 + tt) * pc.N + row0 + r] = g;
            }
        }
#endif
    }
}
