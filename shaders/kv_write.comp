#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: KV=f32,f16,q8_0 ACCESS=texel,ssbo
// Store each token's k and v rows at its cache slot: cache[slot, :] = k[t, :]; slot < 0 is
// padding. Caches are [blocks * block_size, kv_dim], written in place.
// f32: one invocation per element. f16: one invocation per u32 word of the cache (a pair of
// halves); with an odd kv_dim a row starts or ends mid-word, and that word's other half
// belongs to a neighbouring slot, so the edge halves are merged with atomics.
// q8_0: one invocation per 32-value block of a row (include/codecs.glsl's quantizer; rows are
// whole block pairs, kv_dim % 64 == 0).
#include "access.glsl"
DECLARE_LOCAL_SIZE;

#if defined(KV_F16) || defined(KV_Q8_0)
RW_U32(0, k_cache);
RW_U32(1, v_cache);
#else
OUT_F32(0, k_cache);
OUT_F32(1, v_cache);
#endif
IN_F32(2, k);
IN_F32(3, v);
IN_I32(4, slots);

// row_items: per token, elements (f32), candidate words (f16: kv_dim / 2 + 1) or blocks (q8_0).
layout(push_constant) uniform Push { uint tokens; uint kv_dim; uint row_items; } pc;

#if defined(KV_F16)
#include "cast.glsl"
// Integer encoding, bit-identical to numpy's astype(float16) and to the cast kernel.
uint f32_to_f16(float f) { return f32_bits_to_f16_bits(floatBitsToUint(f)); }

void store_word(uint word, uint base, uint t_off) {
    uint lo = 2u * word, hi = lo + 1u;
    bool lo_in = lo >= base && lo < base + pc.kv_dim;
    bool hi_in = hi >= base && hi < base + pc.kv_dim;
    if (lo_in && hi_in) {
        uint i = t_off + (lo - base);
        k_cache[word] = f32_to_f16(LD_F32(k, i)) | (f32_to_f16(LD_F32(k, i + 1u)) << 16);
        v_cache[word] = f32_to_f16(LD_F32(v, i)) | (f32_to_f16(LD_F32(v, i + 1u)) << 16);
    } else if (lo_in || hi_in) {
        uint i = t_off + (lo_in ? lo : hi) - base;
        uint shift = lo_in ? 0u : 16u;
        uint keep = ~(0xFFFFu << shift);
        atomicAnd(k_cache[word], keep);
        atomicOr(k_cache[word], f32_to_f16(LD_F32(k, i)) << shift);
        atomicAnd(v_cache[word], keep);
        atomicOr(v_cache[word], f32_to_f16(LD_F32(v, i)) << shift);
    }
}
#elif defined(KV_Q8_0)
#include "codecs.glsl"
#endif

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.row_items) return;
    uint t = i / pc.row_items, item = i % pc.row_items;
    int slot = LD_I32(slots, t);
    if (slot < 0) return;
#if defined(KV_F16)
    uint base = uint(slot) * pc.kv_dim;  // first half of the row
    store_word(base / 2u + item, base, t * pc.kv_dim);
#elif defined(KV_Q8_0)
    uint e = uint(slot) * pc.kv_dim + 32u * item, src = t * pc.kv_dim + 32u * item;
    float x[32];
    for (uint j = 0u; j < 32u; ++j) x[j] = LD_F32(k, src + j);
    STORE_Q8_0(k_cache, e, x);
    for (uint j = 0u; j < 32u; ++j) x[j] = LD_F32(v, src + j);
    STORE_Q8_0(v_cache, e, x);
#else
    uint dst = uint(slot) * pc.kv_dim + item, src = t * pc.kv_dim + item;
    k_cache[dst] = LD_F32(k, src);
    v_cache[dst] = LD_F32(v, src);
#endif
}
