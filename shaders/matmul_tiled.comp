#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: WFMT=f32,f16,bf16,q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_xs,mxfp4 ACCESS=ssbo
// Prefill matmul for GPUs, y[t, n] = sum_k x[t, k] * w[n, k]: matmul_vec.comp's ops (GATES,
// GELU, OUT_SCALE, the rms_norm prologue and the residual add; not its qkv epilogue) with
// both operands staged in shared memory. One workgroup computes a tile of ROWS output rows x
// TOKENS tokens (workgroup id x = row tile, y = token tile). Storage-buffer path only: GPUs
// take it; llvmpipe runs it only when tests force it (its shared-memory loads measured ~20x
// slower than texel loads, docs/ARCHITECTURE.md).
//
// Reduction order: matmul_vec's split-K order for the same SPLIT, bit for bit. Slice j of
// SPLIT folds blocks j, j + SPLIT, ... in order with quant.glsl's block contract, then the
// slices' sums meet in the halving tree (slice j + half into j, half = SPLIT / 2 ... 1) and
// the epilogue is matmul_vec's expressions. The host gives this kernel the split that
// matmul_vec runs on the device for this K, so decode (matmul_vec) and prefill (here) give a
// token the same bits, whatever T and wherever the token sits in the batch
// (docs/ARCHITECTURE.md, invariant 9).
//
// Work split. LANES neighbouring invocations share each output; lane l carries slices l,
// l + LANES, ... as SETS = SPLIT / LANES register accumulators. Each group of LANES owns
// LANE_ROWS rows x LANE_TOKENS tokens of the tile (with GATES = 2 also the matching up rows).
// A step stages LANES consecutive blocks, so block b belongs to slice b % SPLIT, set
// (b / LANES) % SETS of lane b % LANES:
// - w_tile: each of the GATES * ROWS tile rows' block, decoded once (load_wblock: raw quants
//   as floats, float weights as they are) by one invocation; consecutive invocations take
//   consecutive rows, whose blocks are neighbours in the row-tiled layout (coalesced reads).
//   w_scale holds its load_scale entry for combine().
// - x_tile: each token's activation block (times the norm weight with FUSE_RMS), x_sum its
//   block_xsum; a token's LANES blocks go to neighbouring invocations (contiguous reads).
// Then every invocation folds its lane's block for its outputs from shared memory.
// After the last step the sets are added in registers (the tree's halves >= LANES) and the
// lanes through shared memory (the halves < LANES; every lane adds its partner's sum to its
// own, so all lanes end with the same value and share the epilogue's stores). No subgroup
// operations: only barriers and the Vulkan minimum of shared memory (16 KiB) and workgroup
// size (128) for the host's tiles, which keep the staging loads one per invocation:
// (GATES * ROWS + TOKENS) * LANES <= workgroup size, and the lane tree reuses w_tile and
// x_tile (workgroup size * ceil(NACC / 4) <= 8 * GATES * ROWS * LANES).
#include "access.glsl"
#include "gelu.glsl"
DECLARE_LOCAL_SIZE;  // = LANES * (ROWS / LANE_ROWS) * (TOKENS / LANE_TOKENS)
layout(constant_id = 1) const uint ROWS = 8u;
layout(constant_id = 3) const uint TOKENS = 16u;
layout(constant_id = 4) const uint GATES = 1u;  // weight rows per output row: 1 or 2 (gated)
layout(constant_id = 5) const uint LANES = 1u;  // a power of two dividing SPLIT
layout(constant_id = 6) const uint FUSE = 0u;  // FUSE_NONE, FUSE_RMS or FUSE_ADD: matmul_vec's bits, one at a time
layout(constant_id = 8) const uint SPLIT = 1u;  // matmul_vec's SPLIT: a power of two
layout(constant_id = 10) const bool GELU = false;  // the gated activation: gelu_tanh, else silu
layout(constant_id = 11) const float OUT_SCALE = 1.0;
layout(constant_id = 12) const uint LANE_ROWS = 2u;
layout(constant_id = 13) const uint LANE_TOKENS = 2u;
layout(constant_id = 14) const bool BIAS = false;  // FUSE_ADD's operand is one row [N] for every token
const uint FUSE_NONE = 0u, FUSE_RMS = 1u, FUSE_ADD = 2u;
const uint WROWS = ROWS * GATES;  // weight rows staged per tile: gate (or plain) rows, then up rows
const uint LROWS = LANE_ROWS * GATES;  // weight rows per invocation
const uint NACC = LROWS * LANE_TOKENS;  // accumulators per set
const uint NVEC = (NACC + 3u) / 4u;
const uint SETS = SPLIT / LANES;
const uint ROW_GROUPS = ROWS / LANE_ROWS;

#ifdef WFMT_F32
IN_F32X4(0, wq);
#else
IN_U32X4(0, wq);
#endif
IN_F32(1, x);
OUT_F32(2, y);
#if defined(WFMT_Q5_0) || defined(WFMT_Q5_1) || defined(WFMT_IQ4_XS)
#define HAS_SCALES
IN_U32X2(3, ws);  // as in matmul_vec.comp
#elif defined(WFMT_Q8_0) || defined(WFMT_Q4_0) || defined(WFMT_Q4_1) || defined(WFMT_IQ4_NL) || defined(WFMT_Q6_K) || \
    defined(WFMT_Q2_K) || defined(WFMT_MXFP4)
#define HAS_SCALES
IN_U32(3, ws);
#endif
// The fused operand, one binding for every FUSE (a specialisation constant, so one module per
// format serves all three): FUSE_RMS the norm weight [K], FUSE_ADD the residual [T, N] (or a
// bias [N] with BIAS);
// FUSE_NONE never reads it (the host binds x).
IN_F32(4, aux);

// As matmul_vec.comp's: N output rows (GATES * N weight rows), w_row quants texels per weight
// row, s_base the first scales word; eps FUSE_RMS's epsilon.
layout(push_constant) uniform Push { uint T; uint N; uint K; uint blocks; uint w_row; uint s_base; float eps; } pc;

#define MATMUL_IO
#include "quant.glsl"

shared vec4 w_tile[8u * WROWS * LANES];  // [j][tile row][lane]: vec4 j of each staged block
shared vec4 x_tile[8u * TOKENS * LANES];  // [j][token][lane]
shared SCALE_T w_scale[WROWS * LANES];
#ifdef NEEDS_XSUM
shared PART_T x_sum[TOKENS * LANES];
#endif
shared float inv_rms[TOKENS];

// Tile row of an invocation's weight row q (gate rows first, then the up rows ROWS further).
uint tile_row(uint rg, uint q) {
    return (q / LANE_ROWS) * ROWS + rg * LANE_ROWS + q % LANE_ROWS;
}

void main() {
    uint tid = gl_LocalInvocationIndex;
    uint lane = tid % LANES;
    uint rg = (tid / LANES) % ROW_GROUPS, tg = (tid / LANES) / ROW_GROUPS;
    uint row0 = gl_WorkGroupID.x * ROWS, t0 = gl_WorkGroupID.y * TOKENS;

    // What this invocation stages each step: tile row `item`'s weight block, or token
    // `item`'s activation block, of lane `stage_lane`. Past the last row / token: reload the
    // last one, never store.
    bool stages_w = tid < WROWS * LANES;
    uint xi = tid - WROWS * LANES;
    bool stages_x = !stages_w && xi < TOKENS * LANES;
    uint stage_lane = stages_w ? tid / WROWS : xi % LANES;
    uint item = stages_w ? tid % WROWS : xi / LANES;
    uint n = min(row0 + item % ROWS, pc.N - 1u) + (item / ROWS) * pc.N;
    uint wrow = row_base(n, pc.w_row);
    uvec2 srow = row_scales(n, pc.s_base, pc.blocks, GATES * pc.N);
    uint xt = min(t0 + item, pc.T - 1u);

    float acc[SETS * NACC];
    [[unroll]] for (uint i = 0u; i < SETS * NACC; i++) acc[i] = 0.0;
    vec4 sq[SETS];  // FUSE_RMS, activation stagers: running sums of x^2 per set, as matmul_vec's
    [[unroll]] for (uint s = 0u; s < SETS; s++) sq[s] = vec4(0.0);

    uint steps = (pc.blocks + LANES - 1u) / LANES;
    for (uint step = 0u; step < steps; step++) {
        uint set = step % SETS;
        uint b = step * LANES + stage_lane;
        if (stages_w && b < pc.blocks) {
            SCALE_T scale = load_scale(srow, b);
            vec4 wv[8];
            load_wblock(wrow, b, scale, wv);
            w_scale[item * LANES + stage_lane] = scale;
            [[unroll]] for (uint j = 0u; j < 8u; j++) w_tile[(j * WROWS + item) * LANES + stage_lane] = wv[j];
        } else if (stages_x && b < pc.blocks) {
            vec4 xv[8];
            load_x(xt, b, pc.K, xv);
            if (FUSE == FUSE_RMS) {
                vec4 s4 = sq[0];
                [[unroll]] for (uint s = 1u; s < SETS; s++) s4 = s == set ? sq[s] : s4;
                [[unroll]] for (uint j = 0u; j < 8u; j++) {
                    vec4 gv;
                    [[unroll]] for (uint c = 0u; c < 4u; c++) {
                        uint k = b * 32u + 4u * j + c;
                        gv[c] = k < pc.K ? LD_F32(aux, k) : 0.0;
                    }
                    precise vec4 s = fma(xv[j], xv[j], s4);
                    s4 = s;
                    xv[j] *= gv;
                }
                [[unroll]] for (uint s = 0u; s < SETS; s++) sq[s] = s == set ? s4 : sq[s];
            }
#ifdef NEEDS_XSUM
            x_sum[item * LANES + stage_lane] = block_xsum(xv);
#endif
            [[unroll]] for (uint j = 0u; j < 8u; j++) x_tile[(j * TOKENS + item) * LANES + stage_lane] = xv[j];
        }
        memoryBarrierShared();
        barrier();
        if (step * LANES + lane < pc.blocks) {
            PART_T p[NACC];
            [[unroll]] for (uint i = 0u; i < NACC; i++) p[i] = PART_T(0.0);
            [[unroll]] for (uint j = 0u; j < 8u; j++) {
                vec4 wv[LROWS], xv[LANE_TOKENS];
                [[unroll]] for (uint q = 0u; q < LROWS; q++) wv[q] = w_tile[(j * WROWS + tile_row(rg, q)) * LANES + lane];
                [[unroll]] for (uint u = 0u; u < LANE_TOKENS; u++)
                    xv[u] = x_tile[(j * TOKENS + tg * LANE_TOKENS + u) * LANES + lane];
                [[unroll]] for (uint q = 0u; q < LROWS; q++)
                    [[unroll]] for (uint u = 0u; u < LANE_TOKENS; u++)
                        p[q * LANE_TOKENS + u] = block_part_step(p[q * LANE_TOKENS + u], j, wv[q], xv[u]);
            }
            SCALE_T scale[LROWS];
            PART_T xsum[LANE_TOKENS];
            [[unroll]] for (uint q = 0u; q < LROWS; q++) scale[q] = w_scale[tile_row(rg, q) * LANES + lane];
            [[unroll]] for (uint u = 0u; u < LANE_TOKENS; u++) {
                xsum[u] = PART_T(0.0);
#ifdef NEEDS_XSUM
                xsum[u] = x_sum[(tg * LANE_TOKENS + u) * LANES + lane];
#endif
            }
            // The step's set, chosen by unrolled branches so acc stays in registers.
            [[unroll]] for (uint s = 0u; s < SETS; s++) {
                if (s != set) continue;
                [[unroll]] for (uint q = 0u; q < LROWS; q++)
                    [[unroll]] for (uint u = 0u; u < LANE_TOKENS; u++) {
                        uint i = s * NACC + q * LANE_TOKENS + u;
                        acc[i] = combine(acc[i], p[q * LANE_TOKENS + u], scale[q], xsum[u]);
                    }
            }
        }
        barrier();  // the next step overwrites the tiles
    }

    // The tree's halves >= LANES: set s + half / LANES into set s, in registers.
    [[unroll]] for (uint h = SETS / 2u; h > 0u; h /= 2u) {
        [[unroll]] for (uint s = 0u; s < h; s++) {
            [[unroll]] for (uint i = 0u; i < NACC; i++) {
                precise float v = acc[s * NACC + i] + acc[(s + h) * NACC + i];
                acc[s * NACC + i] = v;
            }
            precise vec4 v4 = sq[s] + sq[s + h];
            sq[s] = v4;
        }
    }
    // The halves < LANES: lane l + half into lane l (and l into l + half, the same sum), the
    // accumulators through w_tile, the x^2 sums through x_tile.
    [[unroll]] for (uint h = LANES / 2u; h > 0u; h /= 2u) {
        [[unroll]] for (uint v = 0u; v < NVEC; v++) {
            vec4 mine = vec4(0.0);
            [[unroll]] for (uint c = 0u; c < 4u; c++) if (4u * v + c < NACC) mine[c] = acc[4u * v + c];
            w_tile[tid * NVEC + v] = mine;
        }
        if (FUSE == FUSE_RMS && stages_x) x_tile[xi] = sq[0];
        memoryBarrierShared();
        barrier();
        [[unroll]] for (uint v = 0u; v < NVEC; v++) {
            vec4 other = w_tile[(tid ^ h) * NVEC + v];
            [[unroll]] for (uint c = 0u; c < 4u; c++) {
                if (4u * v + c < NACC) {
                    precise float s = acc[4u * v + c] + other[c];
                    acc[4u * v + c] = s;
                }
            }
        }
        if (FUSE == FUSE_RMS && stages_x) {
            precise vec4 s4 = sq[0] + x_tile[xi ^ h];
            sq[0] = s4;
        }
        barrier();
    }
    if (FUSE == FUSE_RMS) {
        if (stages_x && stage_lane == 0u) {
            precise vec2 s2 = sq[0].xy + sq[0].zw;
            precise float inv = 1.0 / sqrt((s2.x + s2.y) / float(pc.K) + pc.eps);
            inv_rms[item] = inv;
        }
        memoryBarrierShared();
        barrier();
    }

    // The epilogue, matmul_vec.comp's expressions; lane l stores every LANES-th output.
    [[unroll]] for (uint u = 0u; u < LANE_TOKENS; u++) {
        uint tt = tg * LANE_TOKENS + u;
        uint t = t0 + tt;
        float inv = FUSE == FUSE_RMS ? inv_rms[tt] : 1.0;
        [[unroll]] for (uint r = 0u; r < LANE_ROWS; r++) {
            uint row = row0 + rg * LANE_ROWS + r;
            if ((u * LANE_ROWS + r) % LANES != lane || t >= pc.T || row >= pc.N) continue;
            float g = acc[r * LANE_TOKENS + u] * inv;
            if (GATES == 2u) {
                float up = acc[(LANE_ROWS + r) * LANE_TOKENS + u] * inv;
                if (GELU) {
                    g = gelu_tanh_mul(g, up);  // include/gelu.glsl, as elementwise.comp's gelu_mul
                } else {
                    g = g / (1.0 + exp(-g)) * up;  // elementwise.comp's silu_mul, verbatim
                }
            }
            if (OUT_SCALE != 1.0) {
                precise float scaled = g * OUT_SCALE;
                g = scaled;
            }
            if (FUSE == FUSE_ADD) {
                // precise: the add of the rounded output, as the add op (and matmul_vec) sees it.
                precise float sum = g + LD_F32(aux, (BIAS ? 0u : t * pc.N) + row);
                g = sum;
            }
            y[t * pc.N + row] = g;
        }
    }
}
