#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: KV=f32,f16 ACCESS=texel,ssbo
// qkv_rope_kv_write: the attention prologue in one dispatch. qkv [T, (H + 2 KVH) * head_dim]
// is the stacked q/k/v projection; q = rope(qkv[:, q cols]) goes to the output, and
// rope(k) and v are stored at the token's cache slot (slot < 0: padding, nothing stored).
// Bit-identical to rope.comp followed by kv_write.comp: the same `precise` rotation per
// element, and f16 caches encoded with include/cast.glsl's integer encoder (numpy rounding).
// Per token the invocations are: q_width q elements, then kv_items cache items (f32: one
// element of k and v each; f16: one u32 word = two halves of k and v each; head_dim is even,
// so kv_dim is even and every cache row is whole words, no edge merging).
#include "access.glsl"
#include "cast.glsl"
DECLARE_LOCAL_SIZE;

IN_F32(0, qkv);
IN_I32(1, positions);
IN_F32(2, cos_sin);
#if defined(KV_F16)
OUT_U32(3, k_cache);
OUT_U32(4, v_cache);
#else
OUT_F32(3, k_cache);
OUT_F32(4, v_cache);
#endif
IN_I32(5, slots);
OUT_F32(6, q);

#if defined(KV_F16)
#define KV_ELEMS 2u
#else
#define KV_ELEMS 1u
#endif

layout(push_constant) uniform Push {
    uint tokens;
    uint q_width;        // num_heads * head_dim
    uint kv_dim;         // num_kv_heads * head_dim
    uint head_dim;
    uint rot_dim;
    uint max_positions;
    uint interleaved;
    uint row_items;      // q_width + kv_items
} pc;

// Element `col` of token t's qkv row after rope (k and v columns start on head boundaries,
// so col % head_dim is the dim within its head). As rope.comp, term for term.
float roped(uint t, uint col, uint p) {
    uint i = t * (pc.q_width + 2u * pc.kv_dim) + col;
    uint d = col % pc.head_dim;
    if (d >= pc.rot_dim) return LD_F32(qkv, i);
    uint half_rot = pc.rot_dim / 2u;
    uint j, partner;
    bool first;
    if (pc.interleaved != 0u) {
        j = d / 2u;
        first = (d & 1u) == 0u;
        partner = first ? i + 1u : i - 1u;
    } else {
        first = d < half_rot;
        j = first ? d : d - half_rot;
        partner = first ? i + half_rot : i - half_rot;
    }
    float c = LD_F32(cos_sin, p * pc.rot_dim + j);
    float s = LD_F32(cos_sin, p * pc.rot_dim + half_rot + j);
    precise float out_value = first ? LD_F32(qkv, i) * c - LD_F32(qkv, partner) * s
                                    : LD_F32(qkv, i) * c + LD_F32(qkv, partner) * s;
    return out_value;
}

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.row_items) return;
    uint t = i / pc.row_items, item = i % pc.row_items;
    // Clamped so a bad position reads a wrong angle instead of out of bounds.
    uint p = uint(clamp(LD_I32(positions, t), 0, int(pc.max_positions) - 1));
    if (item < pc.q_width) {
        q[t * pc.q_width + item] = roped(t, item, p);
        return;
    }
    int slot = LD_I32(slots, t);
    if (slot < 0) return;
    uint k_col = pc.q_width + (item - pc.q_width) * KV_ELEMS;
    uint v_src = t * (pc.q_width + 2u * pc.kv_dim) + k_col + pc.kv_dim;
    uint dst = uint(slot) * (pc.kv_dim / KV_ELEMS) + (item - pc.q_width);
#if defined(KV_F16)
    k_cache[dst] = f32_bits_to_f16_bits(floatBitsToUint(roped(t, k_col, p)))
                 | (f32_bits_to_f16_bits(floatBitsToUint(roped(t, k_col + 1u, p))) << 16);
    v_cache[dst] = f32_bits_to_f16_bits(floatBitsToUint(LD_F32(qkv, v_src)))
                 | (f32_bits_to_f16_bits(floatBitsToUint(LD_F32(qkv, v_src + 1u))) << 16);
#else
    k_cache[dst] = roped(t, k_col, p);
    v_cache[dst] = LD_F32(qkv, v_src);
#endif
}
