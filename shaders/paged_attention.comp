#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: KV=f32,f16 ACCESS=texel,ssbo
// Paged causal GQA: token t of sequence seq_index[t] attends to positions 0..positions[t],
// whose keys and values sit at cache slot block_table[seq, p / block_size] * block_size +
// p % block_size. seq_index < 0 marks a padding row (output zeros). One invocation per
// (token, head), invocation i = t * num_heads + h, so a SIMD batch holds the heads of one
// token and its lanes loop over the same context length. Everything that changes per step
// (positions, seq_index, block_table) is read from buffers: a recorded step can be replayed.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint HD4 = 16;  // head_dim / 4

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

// group = num_heads / num_kv_heads; kv_dim4 = num_kv_heads * head_dim / 4 (texels per slot).
layout(push_constant) uniform Push {
    uint tokens; uint num_heads; uint group; uint kv_dim4;
    uint block_size; uint max_blocks; float scale;
} pc;

#include "attention.glsl"

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
    float q_scale = pc.scale * LOG2E;
    for (uint d = 0u; d < HD4; ++d) q_reg[d] = LD_F32X4(q, out_row + d) * q_scale;
    attend_begin();
    uint head_texel = (h / pc.group) * HD4;
    uint table_row = uint(seq) * pc.max_blocks;
    for (uint start = 0u, b = 0u; start < n; start += pc.block_size, ++b) {
        uint block = uint(LD_I32(block_table, table_row + b));
        uint row = block * pc.block_size * pc.kv_dim4 + head_texel;
        uint count = min(pc.block_size, n - start);
        for (uint j = 0u; j < count; ++j, row += pc.kv_dim4) attend_position(row);
    }
    float inv_sum = 1.0 / run_sum;
    for (uint d = 0u; d < HD4; ++d) o[out_row + d] = acc[d] * inv_sum;
}
