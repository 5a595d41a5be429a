#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_arithmetic : require
//! variants: KV=f32,f16,q8_0 ACCESS=texel,ssbo
// paged_attention for steps with many query tokens per sequence (prefill), in tiles. The math
// and the buffers are paged_attention.comp's (same bindings, window and softcap rules, padding
// rows); what differs is who loads what. One workgroup = one subgroup of LANES invocations
// owns a tile: TILE consecutive tokens of the batch x HEADS query heads that share one KV
// head (ROWS query rows). Lane l folds, for every row of the tile, the positions
// first + l, first + l + LANES, ... of that row's context, exactly the positions and order
// paged_attention.comp's SPLIT_SUB lane l folds for that row, with the same functions
// (include/attention.glsl: score, online-softmax update, lane merge, all `precise`), so a
// row's output is bit-identical to that kernel's and depends only on the device and its own
// sequence. A key /
// value row is loaded once per tile for all its rows instead of once per row: at round j a
// lane's position is the same for every row whose window starts at the same place (always,
// without a sliding window), and the lane keeps the last row it loaded in registers. The
// online-softmax states (running max, sum, accumulator) of the ROWS rows stay in registers;
// scores exist one at a time. Keys and values are not staged in shared memory: on llvmpipe
// shared-memory loads measured ~20x slower than texel loads (docs/ARCHITECTURE.md), and the
// lanes read disjoint positions, so there is nothing to share across lanes.
// Tokens of a tile may belong to different sequences (tiles do not align to sequences): a
// lane reloads when the sequence or the position changes. Everything that changes per step
// (positions, seq_index, block_table) is read from buffers: a recorded step can be replayed.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 0) const uint LANES = 8u;  // = the workgroup size = the subgroup size
layout(constant_id = 1) const uint HD4 = 16;    // head_dim / 4
layout(constant_id = 2) const float SOFTCAP = 0.0;
// The tile's shape is constant so its loops unroll and every row's state is addressed by a
// constant index: llvmpipe then keeps it in registers (indexed at run time it went to memory
// and the kernel ran 5x slower than the paged one).
layout(constant_id = 3) const uint TILE = 1u;   // query tokens per tile
layout(constant_id = 4) const uint HEADS = 1u;  // query heads per tile, all of one KV head
const uint ROWS = TILE * HEADS;

IN_F32X4(0, q);
#if defined(KV_F16)
IN_U32X2(1, k_cache);  // 4 halves per texel
IN_U32X2(2, v_cache);
vec4 halves4(uvec2 w) { return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
#define LD_K(i) halves4(LD_U32X2(k_cache, i))
#define LD_V(i) halves4(LD_U32X2(v_cache, i))
#elif defined(KV_Q8_0)
#include "codecs.glsl"
IN_U32(1, k_cache);  // q8_0 words (include/codecs.glsl): a texel is the 4 values of one quant word
IN_U32(2, v_cache);
#define LD_K(i) LD_Q8_0(k_cache, i)
#define LD_V(i) LD_Q8_0(v_cache, i)
#else
IN_F32X4(1, k_cache);
IN_F32X4(2, v_cache);
#define LD_K(i) LD_F32X4(k_cache, i)
#define LD_V(i) LD_F32X4(v_cache, i)
#endif
IN_I32(3, block_table);
IN_I32(4, seq_index);
IN_I32(5, positions);
OUT_F32X4(6, o);

// group = num_heads / num_kv_heads (a multiple of HEADS); kv_dim4 = num_kv_heads * head_dim / 4
// (texels per slot); window: 0 = the whole context.
layout(push_constant) uniform Push {
    uint tokens; uint num_heads; uint group; uint kv_dim4;
    uint block_size; uint max_blocks; float scale; uint window;
} pc;

// The rows' states are include/attention.glsl's arrays with a row per query of the tile, so a
// row is folded and merged by the very functions paged_attention.comp calls.
const uint ATTENTION_ROWS = ROWS;
vec4 k_row[HD4];  // the key and value row this lane loaded last
vec4 v_row[HD4];
#define KEY(kv_row, d) k_row[d]
#define VALUE(kv_row, d) v_row[d]
#define ATTENTION_PAGED
#define ATTENTION_SUBGROUP
#include "softcap.glsl"
#include "attention.glsl"

int tile_seq[TILE];       // per token of the tile: its sequence (< 0: padding or past the batch),
uint tile_first[TILE];    // its first position and its context length n
uint tile_n[TILE];

void main() {
    uint i = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    uint tiles = (pc.tokens + TILE - 1u) / TILE;
    uint head_tiles = pc.num_heads / HEADS;
    if (i >= tiles * head_tiles) return;  // the whole subgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint t0 = (i / head_tiles) * TILE, head0 = (i % head_tiles) * HEADS;
    uint head_texel = (head0 / pc.group) * HD4;
    float q_scale = attention_prescale(pc.scale);
    uint rounds = 0u;
    for (uint tq = 0u; tq < TILE; ++tq) {
        uint t = t0 + tq;
        int seq = t < pc.tokens ? LD_I32(seq_index, t) : -1;
        uint n = seq < 0 ? 0u : context_end(t);
        uint first = window_start(n);
        tile_seq[tq] = seq;
        tile_first[tq] = first;
        tile_n[tq] = n;
        rounds = max(rounds, (n - first + LANES - 1u) / LANES);
        // A row without a sequence is never folded nor stored: its state stays unset.
        if (seq >= 0)
            for (uint g = 0u; g < HEADS; ++g) attend_begin(tq * HEADS + g, (t * pc.num_heads + head0 + g) * HD4, q_scale);
    }
    int loaded_seq = -1;
    uint loaded_p = 0xFFFFFFFFu;
    for (uint j = 0u; j < rounds; ++j) {
        [[unroll]] for (uint tq = 0u; tq < TILE; ++tq) {  // unrolled: see attend_position
            int seq = tile_seq[tq];
            uint p = tile_first[tq] + lane + j * LANES;
            if (seq < 0 || p >= tile_n[tq]) continue;
            if (p != loaded_p || seq != loaded_seq) {
                uint block = uint(LD_I32(block_table, uint(seq) * pc.max_blocks + p / pc.block_size));
                uint row = (block * pc.block_size + p % pc.block_size) * pc.kv_dim4 + head_texel;
                [[unroll]] for (uint d = 0u; d < HD4; ++d) k_row[d] = LD_K(row + d);
                [[unroll]] for (uint d = 0u; d < HD4; ++d) v_row[d] = LD_V(row + d);
                loaded_p = p;
                loaded_seq = seq;
            }
            [[unroll]] for (uint g = 0u; g < HEADS; ++g) attend_position(tq * HEADS + g, 0u);
        }
    }
    // The merge, per row. tile_seq is the same in every lane, so the subgroup operations run in
    // uniform control flow.
    for (uint tq = 0u; tq < TILE; ++tq) {
        uint t = t0 + tq;
        if (t >= pc.tokens) break;
        for (uint g = 0u; g < HEADS; ++g) {
            uint out_row = (t * pc.num_heads + head0 + g) * HD4;
            if (tile_seq[tq] < 0) {
                if (lane == 0u)
                    for (uint d = 0u; d < HD4; ++d) o[out_row + d] = vec4(0.0);
                continue;
            }
            attend_store(tq * HEADS + g, out_row, false);
        }
    }
}
