#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: OP=copy,convert ACCESS=texel,ssbo
// copy: y = x, word by word (any dtype; a 16-bit tensor's half-used last word is copied whole).
// convert: y = cast(x) between f32, f16 and bf16 (formats are spec constants 1 and 2), bit-exact
// with the numpy reference. Every invocation writes one whole u32 word of y: two values of a
// 16-bit output, since a shader cannot store 16 bits into a uint[] without racing its
// neighbour. Values travel as raw bits (u32 views) so no float move can touch NaN payloads or
// denormals (the bf16 encoder of codecs.glsl takes a float, but only bit-casts it).
#include "access.glsl"
#include "codecs.glsl"
#include "cast.glsl"
DECLARE_LOCAL_SIZE;

IN_U32(0, x);
OUT_U32(1, y);

const uint F32 = 0u, F16 = 1u, BF16 = 2u;
layout(constant_id = 1) const uint SRC = F32;
layout(constant_id = 2) const uint DST = F32;

// copy: n = words; convert: n = values (each invocation takes values 2i and 2i + 1).
layout(push_constant) uniform Push { uint n; } pc;

uint to_f32_bits(uint v) {
    if (SRC == F16) return f16_bits_to_f32_bits(v);
    if (SRC == BF16) return v << 16;
    return v;
}

uint from_f32_bits(uint u) {
    if (DST == F16) return f32_bits_to_f16_bits(u);
    return f32_to_bf16(uintBitsToFloat(u));
}

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
#if defined(OP_COPY)
    if (i < pc.n) y[i] = LD_U32(x, i);
#else
    uint lo = 2u * i;
    if (lo >= pc.n) return;
    bool has_hi = lo + 1u < pc.n;
    uint a, b;  // f32 bits of values lo and lo + 1
    if (SRC == F32) {
        a = LD_U32(x, lo);
        b = has_hi ? LD_U32(x, lo + 1u) : 0u;
    } else {
        uint word = LD_U32(x, i);  // a 16-bit input's word i holds exactly values lo and lo + 1
        a = to_f32_bits(word & 0xFFFFu);
        b = to_f32_bits(word >> 16);
    }
    if (DST == F32) {
        y[lo] = a;
        if (has_hi) y[lo + 1u] = b;
    } else {
        // An odd-length output's last word is half padding; it gets zero bits.
        y[i] = from_f32_bits(a) | (has_hi ? from_f32_bits(b) << 16 : 0u);
    }
#endif
}
