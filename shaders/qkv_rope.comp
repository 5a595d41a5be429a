#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: KV=f32,f16,q8_0 NORM=none,qk ACCESS=texel,ssbo
// qkv_rope_kv_write: the attention prologue in one dispatch. qkv [T, (H + 2 KVH) * head_dim]
// is the stacked q/k/v projection; q = rope(qkv[:, q cols]) goes to the output, and
// rope(k) and v are stored at the token's cache slot (slot < 0: padding, nothing stored).
// Bit-identical to rope.comp followed by kv_write.comp: the same rotation per element
// (include/rope.glsl), and f16 caches encoded with include/cast.glsl's integer encoder
// (numpy rounding).
// Per token the invocations are: q_width q elements, then kv_items cache items (f32: one
// element of k and v each; f16: one u32 word = two halves of k and v each; head_dim is even,
// so kv_dim is even and every cache row is whole words, no edge merging; q8_0: one 32-value
// block of k and v each, quantized by include/codecs.glsl as kv_write.comp does).
// NORM_QK (qkv_norm_rope_kv_write, the QK-norm of Qwen3 and Gemma 3): each q and k head is
// first RMS-normalised with the weights q_norm / k_norm [head_dim]. One workgroup of
// ROW_LANES lanes per (token, head of the H + 2 KVH): the head's sum of squares is reduced
// exactly as norm.comp reduces a row of head_dim, and x * inv * w is norm.comp's expression,
// so the result is bit-identical to rms_norm over [T * heads, head_dim] views followed by
// this shader's NORM_NONE variant. Specialisation constant 1 (V_NORM, Gemma 4) norms each v
// head too, without a weight (x * inv * 1.0: rms_norm's bits with a weight of ones).
#include "access.glsl"
#include "cast.glsl"
#ifdef NORM_QK
#include "reduce.glsl"
#endif
DECLARE_LOCAL_SIZE;

IN_F32(0, qkv);
IN_I32(1, positions);
IN_F32(2, cos_sin);
#if defined(KV_F16)
OUT_U32(3, k_cache);
OUT_U32(4, v_cache);
#elif defined(KV_Q8_0)
RW_U32(3, k_cache);  // RW: a block's scale half is merged into its word with atomics
RW_U32(4, v_cache);
#else
OUT_F32(3, k_cache);
OUT_F32(4, v_cache);
#endif
IN_I32(5, slots);
OUT_F32(6, q);
#ifdef NORM_QK
IN_F32(7, q_norm);
IN_F32(8, k_norm);
#endif

#if defined(KV_F16)
#define KV_ELEMS 2u
#elif defined(KV_Q8_0)
#include "codecs.glsl"
#define KV_ELEMS 32u  // values per cache item: one q8_0 block
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
#ifdef NORM_QK
    float eps;
#endif
} pc;

#ifdef NORM_QK
layout(constant_id = 1) const bool V_NORM = false;
float head_inv;    // 1 / rms of the workgroup's head
bool head_is_q;    // which norm weights it takes
// Element i of the qkv buffer (dim d of its head), normalised as norm.comp normalises it.
float source(uint i, uint d) {
    return LD_F32(qkv, i) * head_inv * (head_is_q ? LD_F32(q_norm, d) : LD_F32(k_norm, d));
}
// Element i of a v head as it is cached: normalised (V_NORM) or as projected.
float value(uint i) { return V_NORM ? LD_F32(qkv, i) * head_inv * 1.0 : LD_F32(qkv, i); }
#else
float source(uint i, uint d) { return LD_F32(qkv, i); }
#endif

// Element `col` of token t's qkv row after rope (k and v columns start on head boundaries,
// so col % head_dim is the dim within its head): include/rope.glsl's, as rope.comp's.
#define ROPE_LOAD(i, d) source(i, d)
#include "rope.glsl"
float roped(uint t, uint col, uint p) {
    return rope_element(t * (pc.q_width + 2u * pc.kv_dim) + col, col % pc.head_dim, p, pc.rot_dim,
                        pc.interleaved != 0u);
}

#ifdef NORM_QK
void main() {
    uint heads = (pc.q_width + 2u * pc.kv_dim) / pc.head_dim;
    uint wg = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (wg >= pc.tokens * heads) return;  // the whole workgroup leaves: no barrier is skipped
    uint lane = gl_LocalInvocationID.x;
    uint t = wg / heads, head = wg % heads;
    uint q_heads = pc.q_width / pc.head_dim, kv_heads = pc.kv_dim / pc.head_dim;
    uint col0 = head * pc.head_dim;  // the head's first column in qkv
    uint row0 = t * (pc.q_width + 2u * pc.kv_dim) + col0;
    head_is_q = head < q_heads;
    bool is_v = head >= q_heads + kv_heads;
    if (!is_v || V_NORM) {  // uniform per workgroup, so the reduction's barriers are reached by all lanes
        float sq = 0.0;
        for (uint j = lane; j < pc.head_dim; j += ROW_LANES) {
            float v = LD_F32(qkv, row0 + j);
            sq += v * v;
        }
        head_inv = 1.0 / sqrt(workgroup_sum(sq) / float(pc.head_dim) + pc.eps);
    }
    uint p = rope_position(t, pc.max_positions);
    if (head_is_q) {
        for (uint j = lane; j < pc.head_dim; j += ROW_LANES) q[t * pc.q_width + col0 + j] = roped(t, col0 + j, p);
        return;
    }
    int slot = LD_I32(slots, t);
    if (slot < 0) return;
    uint kv_head = is_v ? head - q_heads - kv_heads : head - q_heads;
    uint dst0 = uint(slot) * (pc.kv_dim / KV_ELEMS) + kv_head * (pc.head_dim / KV_ELEMS);
    for (uint w = lane; w < pc.head_dim / KV_ELEMS; w += ROW_LANES) {
        uint col = col0 + w * KV_ELEMS;
#if defined(KV_Q8_0)
        float x[32];
        for (uint j = 0u; j < 32u; ++j) x[j] = is_v ? value(row0 + 32u * w + j) : roped(t, col + j, p);
        if (is_v) STORE_Q8_0(v_cache, 32u * (dst0 + w), x)
        else STORE_Q8_0(k_cache, 32u * (dst0 + w), x)
#elif defined(KV_F16)
        if (is_v) v_cache[dst0 + w] = f32_bits_to_f16_bits(floatBitsToUint(value(row0 + 2u * w)))
                                   | (f32_bits_to_f16_bits(floatBitsToUint(value(row0 + 2u * w + 1u))) << 16);
        else k_cache[dst0 + w] = f32_bits_to_f16_bits(floatBitsToUint(roped(t, col, p)))
                               | (f32_bits_to_f16_bits(floatBitsToUint(roped(t, col + 1u, p))) << 16);
#else
        if (is_v) v_cache[dst0 + w] = value(row0 + w);
        else k_cache[dst0 + w] = roped(t, col, p);
#endif
    }
}
#else
void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.row_items) return;
    uint t = i / pc.row_items, item = i % pc.row_items;
    uint p = rope_position(t, pc.max_positions);
    if (item < pc.q_width) {
        q[t * pc.q_width + item] = roped(t, item, p);
        return;
    }
    int slot = LD_I32(slots, t);
    if (slot < 0) return;
    uint k_col = pc.q_width + (item - pc.q_width) * KV_ELEMS;
    uint v_src = t * (pc.q_width + 2u * pc.kv_dim) + k_col + pc.kv_dim;
    uint dst = uint(slot) * (pc.kv_dim / KV_ELEMS) + (item - pc.q_width);
#if defined(KV_Q8_0)
    float x[32];
    for (uint j = 0u; j < 32u; ++j) x[j] = roped(t, k_col + j, p);
    STORE_Q8_0(k_cache, 32u * dst, x)
    for (uint j = 0u; j < 32u; ++j) x[j] = LD_F32(qkv, v_src + j);
    STORE_Q8_0(v_cache, 32u * dst, x)
#elif defined(KV_F16)
    k_cache[dst] = f32_bits_to_f16_bits(floatBitsToUint(roped(t, k_col, p)))
                 | (f32_bits_to_f16_bits(floatBitsToUint(roped(t, k_col + 1u, p))) << 16);
    v_cache[dst] = f32_bits_to_f16_bits(floatBitsToUint(LD_F32(qkv, v_src)))
                 | (f32_bits_to_f16_bits(floatBitsToUint(LD_F32(qkv, v_src + 1u))) << 16);
#else
    k_cache[dst] = roped(t, k_col, p);
    v_cache[dst] = LD_F32(qkv, v_src);
#endif
}
#endif
