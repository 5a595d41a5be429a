#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_arithmetic : require
//! variants: KV=f32,f16,q8_0 ACCESS=texel,ssbo
// paged_attention for GQA models, every step: the math and the buffers are
// paged_attention.comp's (same bindings, window, softcap and chunk rules, padding rows); what
// differs is who loads what. One workgroup = one subgroup of LANES invocations owns a tile:
// one token x HEADS query heads that share one KV head. Lane l folds, for every row of the
// tile, the positions range.x + l, range.x + l + LANES, ... of each chunk of the row's window,
// exactly the positions and order paged_attention.comp's SPLIT_SUB lane l folds for that row,
// with the same functions (include/attention.glsl: score, online-softmax update, lane merge,
// chunk merge, all `precise`), so a row's output is bit-identical to that kernel's and depends
// only on the device and its own sequence. A key / value row is loaded once per tile for all
// its rows instead of once per row (a third of the loads for 3 heads). The rows'
// online-softmax states stay in registers; scores exist one at a time. Keys and values are not
// staged in shared memory: on llvmpipe shared-memory loads measured ~20x slower than texel
// loads (docs/ARCHITECTURE.md), and the lanes read disjoint positions, so there is nothing to
// share across lanes.
// Chunks (CHUNK > 0, specialisation constant 3): with pc.chunks == 1 a tile walks every chunk
// its window touches and merges them in registers; with pc.chunks > 1 (decode-shaped steps)
// tile i walks chunk i % pc.chunks alone and stores its rows' partial states for
// paged_attention_merge.comp (the layout of paged_attention.comp's partials). Everything that
// changes per step (positions, seq_index, block_table) is read from buffers: a recorded step
// can be replayed.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 0) const uint LANES = 8u;  // = the workgroup size = the subgroup size
layout(constant_id = 1) const uint HD4 = 16;    // head_dim / 4
layout(constant_id = 2) const float SOFTCAP = 0.0;
layout(constant_id = 3) const uint CHUNK = 0u;  // positions per chunk; 0: one chunk
// The tile's height is constant so its loops unroll and every row's state is addressed by a
// constant index: llvmpipe then keeps it in registers (indexed at run time it went to memory
// and the kernel ran 5x slower than the paged one).
layout(constant_id = 4) const uint HEADS = 1u;  // query heads per tile, all of one KV head

IN_F32X4(0, q);
#define KV_F16_WIDE  // the host binds 8 halves per texel (head_dim a multiple of 8)
#include "kv_cache.glsl"
IN_I32(3, block_table);
IN_I32(4, seq_index);
IN_I32(5, positions);
OUT_F32X4(6, o);

// group = num_heads / num_kv_heads (a multiple of HEADS); kv_dim4 = num_kv_heads * head_dim / 4
// (texels per slot); window: 0 = the whole context.
layout(push_constant) uniform Push {
    uint tokens; uint num_heads; uint group; uint kv_dim4;
    uint block_size; uint max_blocks; float scale; uint window;
    uint chunks; uint token0;  // chunks per tile (1: the tile walks them all); first token handled
} pc;

// The rows' states are include/attention.glsl's arrays with a row per query head of the tile,
// so a row is folded and merged by the very functions paged_attention.comp calls.
const uint ATTENTION_ROWS = HEADS;
vec4 k_row[HD4];  // the key and value row of this lane's current position
vec4 v_row[HD4];
#define ATTENTION_PAGED
#define ATTENTION_SUBGROUP
#include "softcap.glsl"
#include "attention.glsl"

void main() {
    uint i = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    uint head_tiles = pc.num_heads / HEADS;
    if (i >= pc.tokens * head_tiles * pc.chunks) return;  // the whole subgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint item = i / pc.chunks;  // (token, tile) of the slab
    uint t = pc.token0 + item / head_tiles, head0 = (item % head_tiles) * HEADS;
    int seq = LD_I32(seq_index, t);
    if (seq < 0) {  // a padding row; split: the merge writes the zeros
        if (lane == 0u && pc.chunks == 1u)
            for (uint g = 0u; g < HEADS; ++g)
                for (uint d = 0u; d < HD4; ++d) o[(t * pc.num_heads + head0 + g) * HD4 + d] = vec4(0.0);
        return;
    }
    uint n = context_end(t), first = window_start(n);
    uvec2 span = pc.chunks > 1u ? uvec2(i % pc.chunks) : chunk_span(first, n);
    uvec2 first_chunk = chunk_range(first, n, span.x);
    if (first_chunk.x >= first_chunk.y) return;  // a split tile whose chunk the window misses (uniform)
    uint head_texel = (head0 / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    float q_scale = attention_prescale(pc.scale);
    [[unroll]] for (uint g = 0u; g < HEADS; ++g) {
        attend_load_q(g, (t * pc.num_heads + head0 + g) * HD4, q_scale);
        merged_reset(g);
    }
    for (uint c = span.x; c <= span.y; ++c) {
        uvec2 range = chunk_range(first, n, c);
        [[unroll]] for (uint g = 0u; g < HEADS; ++g) attend_reset(g);
        // Position p = b * block_size + off, advanced by LANES without a division per step.
        uint start = range.x + lane;
        uint b = start / pc.block_size, off = start % pc.block_size;
        for (uint p = start; p < range.y; p += LANES) {
            uint block = uint(LD_I32(block_table, table_row + b));
            attend_position((block * pc.block_size + off) * pc.kv_dim4 + head_texel);
            off += LANES;
            while (off >= pc.block_size) { off -= pc.block_size; ++b; }
        }
        [[unroll]] for (uint g = 0u; g < HEADS; ++g) {
            attend_lanes_merge(g);
            // partial rows: per (token, head) of the slab, pc.chunks of them
            uint part = ((item / head_tiles) * pc.num_heads + head0 + g) * pc.chunks + c;
            if (pc.chunks > 1u) attend_store_partial(g, part * (HD4 + 1u));
            else merge_chunk(g);
        }
    }
    if (pc.chunks == 1u)
        [[unroll]] for (uint g = 0u; g < HEADS; ++g) attend_store_merged(g, (t * pc.num_heads + head0 + g) * HD4);
}
