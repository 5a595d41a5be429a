#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#ifdef SPLIT_SUB
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
//! variants: KV=f32,f16,f16x8,q8_0 SPLIT=seq,sub ACCESS=texel,ssbo
// Paged causal GQA: token t of sequence seq_index[t] attends to positions 0..positions[t]
// (with a sliding window W > 0 only to positions[t] - W < j <= positions[t]), whose keys and
// values sit at cache slot block_table[seq, p / block_size] * block_size + p % block_size;
// table entries before the window are never read. SOFTCAP c > 0 (specialisation constant 2,
// static per layer) caps scores at c * tanh(s / c). seq_index < 0 marks a padding row
// (output zeros). Everything that changes
// per step (positions, seq_index, block_table) is read from buffers: a recorded step can be
// replayed. Two ways to walk the context, both batch invariant (the order depends only on
// per-device constants):
//   SPLIT_SEQ: one invocation per (token, head), invocation i = t * num_heads + h, folding
//     the positions in order (for devices without subgroup arithmetic).
//   SPLIT_SUB: one workgroup = one subgroup of LANES invocations per (token, head), workgroup
//     i = t * num_heads + h; lane l folds positions l, l + LANES, ... into its own online
//     softmax and the lanes' states merge with subgroup max / add. On llvmpipe (LANES = 8,
//     its SIMD width) a 9-head decode step becomes 9 tasks of 1/8 of the context each for
//     the CPU threads instead of 2 walking all of it.
// Chunks (CHUNK > 0, specialisation constant 3): a row's window splits at absolute multiples
// of CHUNK positions, each walked in the order above. With pc.chunks == 1 a work item walks
// every chunk its window touches and merges them in registers (include/attention.glsl's
// merge_chunk); with pc.chunks > 1 (decode-shaped steps, flash-decoding) the grid has
// pc.chunks workgroups (SUB) or invocations (SEQ) per (token, head), chunk c walks its part
// of the window alone, and o receives per (token, head, chunk) the partial softmax state: a
// vec4 (max, sum, 0, 0), then HD4 vec4s of the weighted values, unnormalised, which
// paged_attention_merge.comp folds in the same order with the same weights. A chunk the
// window misses writes nothing (the merge never reads it). Chunk boundaries are absolute
// positions, so a token's result depends only on its own sequence, and it is the same bits
// either way; the grid is sized for the block table's width (fixed at record time) and
// positions are still read from buffers. Tokens pc.token0.. of the batch are handled.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint HD4 = 16;  // head_dim / 4
layout(constant_id = 2) const float SOFTCAP = 0.0;
layout(constant_id = 3) const uint CHUNK = 0u;  // positions per chunk; 0: one chunk
// Attention sinks (gpt-oss): sinks[h] joins head h's softmax denominator after the walk (with
// pc.chunks > 1 the merge pass adds it). Off, the binding is unread and the code folds away.
layout(constant_id = 6) const bool SINKS = false;

IN_F32X4(0, q);
// KV=f16x8: an f16 cache read 8 halves per texel (head_dim a multiple of 8), as the GQA kernel
// reads it: half the loads of KV=f16's 4 per texel, the same values (so the same bits).
#ifdef KV_F16X8
#define KV_F16
#define KV_F16_WIDE
#endif
#include "kv_cache.glsl"
IN_I32(3, block_table);
IN_I32(4, seq_index);
IN_I32(5, positions);
OUT_F32X4(6, o);
IN_F32(7, sinks);

// group = num_heads / num_kv_heads; kv_dim4 = num_kv_heads * head_dim / 4 (texels per slot);
// window: the sliding window in positions, 0 = the whole context.
layout(push_constant) uniform Push {
    uint tokens; uint num_heads; uint group; uint kv_dim4;
    uint block_size; uint max_blocks; float scale; uint window;
    uint chunks; uint token0;  // chunks per (token, head) in the grid (1: it walks them all); first token
} pc;

// One row of state per invocation, and the key and value row of its current position.
const uint ATTENTION_ROWS = 1u;
vec4 k_row[HD4];
vec4 v_row[HD4];
#define ATTENTION_PAGED
#ifdef SPLIT_SUB
#define ATTENTION_SUBGROUP
#endif
#include "softcap.glsl"
#include "attention.glsl"

// Partial state of work item i: (max, sum, 0, 0), then the weighted values.
uint partial_row(uint i) { return i * (HD4 + 1u); }

// Work item i of the grid: its (token, head) row of the batch, and the chunks it walks: every
// chunk its window touches, merged here (pc.chunks == 1), or chunk i % pc.chunks alone, stored
// as a partial (pc.chunks > 1; none if the window misses that chunk).
uint item_row(uint i) { return pc.token0 * pc.num_heads + i / pc.chunks; }
uvec2 item_chunks(uint i, uint first, uint n) {
    uint c = i % pc.chunks;
    return pc.chunks > 1u ? uvec2(c, c) : chunk_span(first, n);
}

#ifdef SPLIT_SUB
layout(constant_id = 0) const uint LANES = 8u;  // = the workgroup size = the subgroup size

void main() {
    uint i = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (i >= pc.tokens * pc.num_heads * pc.chunks) return;  // the whole subgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint row = item_row(i);
    uint t = row / pc.num_heads, h = row % pc.num_heads;
    uint out_row = row * HD4;
    int seq = LD_I32(seq_index, t);
    if (seq < 0) {  // split: the merge writes the zeros
        if (lane == 0u && pc.chunks == 1u)
            for (uint d = 0u; d < HD4; ++d) o[out_row + d] = vec4(0.0);
        return;
    }
    uint n = context_end(t), first = window_start(n);
    uvec2 span = item_chunks(i, first, n);
    uvec2 first_chunk = chunk_range(first, n, span.x);
    if (first_chunk.x >= first_chunk.y) return;  // a split item whose chunk the window misses (uniform)
    uint head_texel = (h / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    attend_load_q(0u, out_row, attention_prescale(pc.scale));
    merged_reset(0u);
    for (uint c = span.x; c <= span.y; ++c) {
        uvec2 range = chunk_range(first, n, c);
        attend_reset(0u);
        uint start = range.x + lane;  // = b * block_size + off
        uint b = start / pc.block_size, off = start % pc.block_size;
        for (uint p = start; p < range.y; p += LANES)
            attend_position(next_texel(table_row, head_texel, b, off, LANES));
        attend_lanes_merge(0u);
        if (pc.chunks > 1u) attend_store_partial(0u, partial_row(i));
        else merge_chunk(0u);
    }
    if (pc.chunks == 1u) {
        if (SINKS) merge_sink(0u, LD_F32(sinks, h));
        attend_store_merged(0u, out_row);
    }
}
#else
void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.num_heads * pc.chunks) return;
    uint row = item_row(i);
    uint t = row / pc.num_heads, h = row % pc.num_heads;
    uint out_row = row * HD4;
    int seq = LD_I32(seq_index, t);
    if (seq < 0) {  // split: the merge writes the zeros
        if (pc.chunks == 1u)
            for (uint d = 0u; d < HD4; ++d) o[out_row + d] = vec4(0.0);
        return;
    }
    uint n = context_end(t), first = window_start(n);
    uvec2 span = item_chunks(i, first, n);
    uvec2 first_chunk = chunk_range(first, n, span.x);
    if (first_chunk.x >= first_chunk.y) return;  // a split item whose chunk the window misses
    uint head_texel = (h / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    attend_load_q(0u, out_row, attention_prescale(pc.scale));
    merged_reset(0u);
    for (uint c = span.x; c <= span.y; ++c) {
        uvec2 range = chunk_range(first, n, c);
        attend_reset(0u);
        for (uint b = range.x / pc.block_size, start = b * pc.block_size; start < range.y; start += pc.block_size, ++b) {
            uint block = uint(LD_I32(block_table, table_row + b));
            uint j = range.x > start ? range.x - start : 0u;  // only the range's first block starts inside
            uint kv_row = (block * pc.block_size + j) * pc.kv_dim4 + head_texel;
            uint count = min(pc.block_size, range.y - start);
            for (; j < count; ++j, kv_row += pc.kv_dim4) {
                attend_position(kv_row);
            }
        }
        if (pc.chunks > 1u) attend_store_partial(0u, partial_row(i));
        else merge_chunk(0u);
    }
    if (pc.chunks == 1u) {
        if (SINKS) merge_sink(0u, LD_F32(sinks, h));
        attend_store_merged(0u, out_row);
    }
}
#endif
