// Integer codecs for 16-bit floats, so no 16-bit storage feature is required.
// bf16 is the high half of an f32; f16 goes through unpackHalf2x16/packHalf2x16.

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
