#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#ifdef SPLIT_SUB
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
//! variants: KV=f32,f16,q8_0 SPLIT=seq,sub ACCESS=texel,ssbo
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
// Split over the context (flash-decoding, CHUNK > 0, specialisation constant 3): the grid
// has pc.chunks workgroups (SUB) or invocations (SEQ) per (token, head), chunk c walking the
// positions [c * CHUNK, (c + 1) * CHUNK) of the window in the order above, and o receives per
// (token, head, chunk) the partial softmax state: a vec4 (max, sum, 0, 0), then HD4 vec4s of
// the weighted values, unnormalised. A chunk that holds no position of the window writes the
// neutral state (max -inf, sum 0, values 0). paged_attention_merge.comp folds the chunks in
// order. Chunk boundaries are absolute positions, so a token's partials depend only on its
// own sequence; the grid is sized for the block table's width (fixed at record time) and
// positions are still read from buffers. Tokens pc.token0.. of the batch are handled.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint HD4 = 16;  // head_dim / 4
layout(constant_id = 2) const float SOFTCAP = 0.0;
layout(constant_id = 3) const uint CHUNK = 0u;  // positions per chunk; 0: one walk per (token, head)

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

// group = num_heads / num_kv_heads; kv_dim4 = num_kv_heads * head_dim / 4 (texels per slot);
// window: the sliding window in positions, 0 = the whole context.
layout(push_constant) uniform Push {
    uint tokens; uint num_heads; uint group; uint kv_dim4;
    uint block_size; uint max_blocks; float scale; uint window;
    uint chunks; uint token0;  // chunks per (token, head) (1 unless CHUNK > 0); first token handled
} pc;

// One row of state per invocation; keys and values are read straight from the cache.
const uint ATTENTION_ROWS = 1u;
#define KEY(kv_row, d) LD_K((kv_row) + (d))
#define VALUE(kv_row, d) LD_V((kv_row) + (d))
#define ATTENTION_PAGED
#ifdef SPLIT_SUB
#define ATTENTION_SUBGROUP
#endif
#include "softcap.glsl"
#include "attention.glsl"

// The positions [lo, hi) chunk c of a token with window start `first` and n positions walks.
uvec2 chunk_range(uint first, uint n, uint c) {
    return CHUNK > 0u ? uvec2(max(first, c * CHUNK), min(n, (c + 1u) * CHUNK)) : uvec2(first, n);
}
// Partial state of chunk (work item) i: (max, sum, 0, 0), then the weighted values.
uint partial_row(uint i) { return i * (HD4 + 1u); }
void write_neutral(uint i) {
    o[partial_row(i)] = vec4(NEG_INF, 0.0, 0.0, 0.0);
    for (uint d = 0u; d < HD4; ++d) o[partial_row(i) + 1u + d] = vec4(0.0);
}

#ifdef SPLIT_SUB
layout(constant_id = 0) const uint LANES = 8u;  // = the workgroup size = the subgroup size

void main() {
    uint i = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (i >= pc.tokens * pc.num_heads * pc.chunks) return;  // the whole subgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint row = pc.token0 * pc.num_heads + i / pc.chunks;  // (token, head) of the batch
    uint t = row / pc.num_heads, h = row % pc.num_heads;
    uint out_row = row * HD4;
    int seq = LD_I32(seq_index, t);
    if (seq < 0) {  // split: the merge writes the zeros
        if (lane == 0u && CHUNK == 0u)
            for (uint d = 0u; d < HD4; ++d) o[out_row + d] = vec4(0.0);
        return;
    }
    uint n = context_end(t);
    uvec2 range = chunk_range(window_start(n), n, i % pc.chunks);
    if (range.x >= range.y) {  // only a chunk outside the window; uniform over the subgroup
        if (lane == 0u) write_neutral(i);
        return;
    }
    attend_begin(0u, out_row, attention_prescale(pc.scale));
    uint head_texel = (h / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    // Position p = b * block_size + off, advanced by LANES without a division per step.
    uint start = range.x + lane;
    uint b = start / pc.block_size, off = start % pc.block_size;
    for (uint p = start; p < range.y; p += LANES) {
        uint block = uint(LD_I32(block_table, table_row + b));
        attend_position(0u, (block * pc.block_size + off) * pc.kv_dim4 + head_texel);
        off += LANES;
        while (off >= pc.block_size) { off -= pc.block_size; ++b; }
    }
    attend_store(0u, CHUNK > 0u ? partial_row(i) : out_row, CHUNK > 0u);
}
#else
void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.num_heads * pc.chunks) return;
    uint row = pc.token0 * pc.num_heads + i / pc.chunks;  // (token, head) of the batch
    uint t = row / pc.num_heads, h = row % pc.num_heads;
    uint out_row = row * HD4;
    int seq = LD_I32(seq_index, t);
    if (seq < 0) {  // split: the merge writes the zeros
        if (CHUNK == 0u)
            for (uint d = 0u; d < HD4; ++d) o[out_row + d] = vec4(0.0);
        return;
    }
    uint n = context_end(t);
    uvec2 range = chunk_range(window_start(n), n, i % pc.chunks);
    if (range.x >= range.y) {  // only a chunk outside the window
        write_neutral(i);
        return;
    }
    attend_begin(0u, out_row, attention_prescale(pc.scale));
    uint head_texel = (h / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    uint first = range.x;
    for (uint b = first / pc.block_size, start = b * pc.block_size; start < range.y; start += pc.block_size, ++b) {
        uint block = uint(LD_I32(block_table, table_row + b));
        uint j = first > start ? first - start : 0u;  // only the range's first block starts inside
        uint kv_row = (block * pc.block_size + j) * pc.kv_dim4 + head_texel;
        uint count = min(pc.block_size, range.y - start);
        for (; j < count; ++j, kv_row += pc.kv_dim4) attend_position(0u, kv_row);
    }
    attend_store(0u, CHUNK > 0u ? partial_row(i) : out_row, CHUNK > 0u);
}
#endif
