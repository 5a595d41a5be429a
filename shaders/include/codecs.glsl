// Integer codecs for 16-bit floats, so no 16-bit storage feature is required.
// bf16 is the high half of an f32; f16 goes through unpackHalf2x16/packHalf2x16.
// Also the q8_0 KV-cache codec (below).

float bf16_lo(uint w) { return uintBitsToFloat(w << 16); }
float bf16_hi(uint w) { return uintBitsToFloat(w & 0xFFFF0000u); }
float f16_lo(uint w) { return unpackHalf2x16(w).x; }
float f16_hi(uint w) { return unpackHalf2x16(w).y; }

// f32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN.
uint f32_to_bf16(float f) {
    uint u = floatBitsToUint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// q8_0 KV cache (vkrt/core/kv_format.py is the spec): GGUF Q8_0 blocks of 32 values, each an f16
// scale d and 32 int8 quants q (value = q * d), paired along the cache; a pair is 17 u32 words:
// its 64 quants (value j in byte j % 4 of word j / 4), then the even block's scale (low half)
// and the odd block's (high half). Value e of the cache (flat index, e % 4 == 0 for a word):
uint q8_0_quant_word(uint e) { return (e >> 6) * 17u + ((e & 63u) >> 2); }
uint q8_0_scale_word(uint e) { return (e >> 6) * 17u + 16u; }
uint q8_0_scale_shift(uint e) { return (e & 32u) >> 1; }  // 0: low half, 16: high half

// The 4 values of one quant word, scaled by the f16 scale in `scales` >> shift (exact in f32).
vec4 q8_0_values(uint quants, uint scales, uint shift) {
    int w = int(quants);
    return vec4(ivec4(w << 24, w << 16, w << 8, w) >> 24) * unpackHalf2x16(scales >> shift).x;
}

#include "cast.glsl"
// Quantize one block as llama.cpp's quantize_row_q8_0_ref does, term for term: d = max |x| / 127,
// q = round(x * (1 / d)) with halves away from zero (0 when d = 0). Returns d's f16 bits; q gets
// the quant words. `precise`: each product and quotient rounded once, as the C code's.
uint q8_0_quantize(float x[32], out uint q[8]) {
    float amax = 0.0;
    for (uint j = 0u; j < 32u; ++j) amax = max(amax, abs(x[j]));
    precise float d = amax / 127.0;
    precise float inverse = d != 0.0 ? 1.0 / d : 0.0;
    for (uint w = 0u; w < 8u; ++w) {
        uint word = 0u;
        for (uint b = 0u; b < 4u; ++b) {
            precise float v = x[4u * w + b] * inverse;
            float r = trunc(v);
            precise float fraction = abs(v - r);  // exact
            if (fraction >= 0.5) r += sign(v);
            word |= (uint(int(r)) & 0xFFu) << (8u * b);
        }
        q[w] = word;
    }
    return f32_bits_to_f16_bits(floatBitsToUint(d));
}

// Store block x at cache value e (a multiple of 32) of the u32 buffer CACHE (declared RW): its 8
// quant words, then its scale half with atomics, since the pair's other block may be another
// invocation's (an And and an Or touch only this block's half, in any interleaving).
#define STORE_Q8_0(CACHE, e, x) {                                                  \
        uint q_[8];                                                                \
        uint d_ = q8_0_quantize(x, q_);                                            \
        uint w_ = q8_0_quant_word(e), shift_ = q8_0_scale_shift(e);                \
        for (uint j_ = 0u; j_ < 8u; ++j_) CACHE[w_ + j_] = q_[j_];                 \
        atomicAnd(CACHE[q8_0_scale_word(e)], ~(0xFFFFu << shift_));                \
        atomicOr(CACHE[q8_0_scale_word(e)], d_ << shift_);                         \
    }
