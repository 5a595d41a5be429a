// Integer f16 codecs on raw bits, matching numpy's float16 conversions bit for bit
// (numpy/_core/src/common/half.c): round to nearest even, subnormals kept, overflow to inf,
// NaN payloads kept (not quietened). Integer math, so neither depends on the device's
// packHalf2x16/unpackHalf2x16 rounding or its denormal handling.
// Shared by cast.comp, kv_write.comp, qkv_rope.comp and codecs.glsl's q8_0 encoder.
#ifndef CAST_GLSL
#define CAST_GLSL

uint f16_bits_to_f32_bits(uint h) {
    uint sign = (h & 0x8000u) << 16;
    uint e = (h >> 10) & 0x1Fu;
    uint m = h & 0x3FFu;
    if (e == 0x1Fu) return sign | 0x7F800000u | (m << 13);           // inf, NaN with its payload
    if (e != 0u) return sign | (((h & 0x7FFFu) << 13) + 0x38000000u);  // normal: rebias 15 -> 127
    if (m == 0u) return sign;                                         // signed zero
    // Subnormal m * 2^-24 becomes a normal f32: exponent from the top set bit of m.
    int top = findMSB(m);                                             // 0..9
    return sign | (uint(top + 103) << 23) | ((m << uint(23 - top)) & 0x7FFFFFu);
}

uint f32_bits_to_f16_bits(uint u) {
    uint sign = (u >> 16) & 0x8000u;
    uint a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7C00u | max((a >> 13) & 0x3FFu, 1u);  // NaN stays NaN
    if (a >= 0x477FF000u) return sign | 0x7C00u;                      // >= 65520 rounds to inf
    if (a >= 0x38800000u) {                                           // normal f16
        uint r = a - 0x38000000u;                                     // rebias 127 -> 15
        return sign | ((r + 0x0FFFu + ((r >> 13) & 1u)) >> 13);       // carries into the exponent
    }
    if (a <= 0x33000000u) return sign;                                // <= 2^-25: ties to zero
    // Subnormal f16: the value is m * 2^(e - 150); in units of 2^-24 that is m >> (126 - e).
    uint shift = 126u - (a >> 23);                                    // 14..24
    uint m = (a & 0x7FFFFFu) | 0x800000u;
    uint q = m >> shift;
    uint rem = m & ((1u << shift) - 1u);
    uint halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u) != 0u)) q += 1u;
    return sign | q;                                                  // may carry to 0x400
}
#endif
