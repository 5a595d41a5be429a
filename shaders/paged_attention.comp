#version 450
#extension GL_GOOGLE_include_directive : require
#ifdef SPLIT_SUB
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
//! variants: KV=f32,f16 SPLIT=seq,sub ACCESS=texel,ssbo
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
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint HD4 = 16;  // head_dim / 4
layout(constant_id = 2) const float SOFTCAP = 0.0;
#define SCORE_SOFTCAP SOFTCAP

IN_F32X4(0, q);
#if defined(KV_F16)
IN_U32X2(1, k_cache);  // 4 halves per texel
IN_U32X2(2, v_cache);
vec4 halves4(uvec2 w) { return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
#define LD_K(i) halves4(LD_U32X2(k_cache, i))
#define LD_V(i) halves4(LD_U32X2(v_cache, i))
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
} pc;

#include "softcap.glsl"
#include "attention.glsl"

// The first position token t attends to, of its n = positions[t] + 1.
uint first_position(uint n) { return pc.window > 0u && n > pc.window ? n - pc.window : 0u; }
// q's pre-scale: into the exp2 domain at once unless scores are capped first.
float q_prescale() { return SOFTCAP > 0.0 ? pc.scale : pc.scale * LOG2E; }

#ifdef SPLIT_SUB
layout(constant_id = 0) const uint LANES = 8u;  // = the workgroup size = the subgroup size

void main() {
    uint i = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (i >= pc.tokens * pc.num_heads) return;  // the whole subgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint t = i / pc.num_heads, h = i % pc.num_heads;
    uint out_row = i * HD4;
    int seq = LD_I32(seq_index, t);
    if (seq < 0) {
        if (lane == 0u)
            for (uint d = 0u; d < HD4; ++d) o[out_row + d] = vec4(0.0);
        return;
    }
    // Never read past the block table, whatever positions[t] says.
    uint n = min(uint(LD_I32(positions, t)) + 1u, pc.max_blocks * pc.block_size);
    float q_scale = q_prescale();
    for (uint d = 0u; d < HD4; ++d) q_reg[d] = LD_F32X4(q, out_row + d) * q_scale;
    attend_begin();
    uint head_texel = (h / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    // Position p = b * block_size + off, advanced by LANES without a division per step.
    uint start = first_position(n) + lane;
    uint b = start / pc.block_size, off = start % pc.block_size;
    for (uint p = start; p < n; p += LANES) {
        uint block = uint(LD_I32(block_table, table_row + b));
        attend_position((block * pc.block_size + off) * pc.kv_dim4 + head_texel);
        off += LANES;
        while (off >= pc.block_size) { off -= pc.block_size; ++b; }
    }
    // Merge: lane 0 saw the first position, so the maximum is finite; a lane that saw nothing (max
    // -inf) weighs 0.
    float m = subgroupMax(run_max);
    float f = run_max == uintBitsToFloat(0xFF800000u) ? 0.0 : exp2(run_max - m);
    float inv_sum = 1.0 / subgroupAdd(run_sum * f);
    for (uint d = 0u; d < HD4; ++d) {
        vec4 total = subgroupAdd(acc[d] * f);
        if (lane == 0u) o[out_row + d] = total * inv_sum;
    }
}
#else
void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.num_heads) return;
    uint t = i / pc.num_heads, h = i % pc.num_heads;
    uint out_row = i * HD4;
    int seq = LD_I32(seq_index, t);
    if (seq < 0) {
        for (uint d = 0u; d < HD4; ++d) o[out_row + d] = vec4(0.0);
        return;
    }
    // Never read past the block table, whatever positions[t] says.
    uint n = min(uint(LD_I32(positions, t)) + 1u, pc.max_blocks * pc.block_size);
    float q_scale = q_prescale();
    for (uint d = 0u; d < HD4; ++d) q_reg[d] = LD_F32X4(q, out_row + d) * q_scale;
    attend_begin();
    uint head_texel = (h / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    uint first = first_position(n);
    for (uint b = first / pc.block_size, start = b * pc.block_size; start < n; start += pc.block_size, ++b) {
        uint block = uint(LD_I32(block_table, table_row + b));
        uint j = first > start ? first - start : 0u;  // only the window's first block starts inside
        uint row = (block * pc.block_size + j) * pc.kv_dim4 + head_texel;
        uint count = min(pc.block_size, n - start);
        for (; j < count; ++j, row += pc.kv_dim4) attend_position(row);
    }
    float inv_sum = 1.0 / run_sum;
    for (uint d = 0u; d < HD4; ++d) o[out_row + d] = acc[d] * inv_sum;
}
#endif
