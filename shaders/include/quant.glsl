// Weight decoding for the device layout of vkrt/backend/vulkan/kernels/layouts.py.
//
// Block formats (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, mxfp4) are split into a quants region of
// uvec4 texels and a scales region of one entry per block: a uint (f16 d in the low half;
// q4_1 keeps f16 m in the high half; mxfp4's E8M0 exponent in the low byte) or, for q5_0 / q5_1, a uvec2 whose .y is the 32 fifth
// bits. Float rows are padded with zeros to whole 32-value blocks, so every weight row is a
// sequence of complete 32-value blocks:
//   f32: 8 texels (RGBA32F) per block, f16/bf16: 4 uvec4 texels, q8_0: 2, the 4-bit ones: 1.
// K-quants are read per 32-value sub-block too: q4_k one texel (q4 nibble order) plus its
// super-block's 16-byte header texel; q5_k the same plus a word of fifth bits (a texel of
// them after the super-block's 8 nibble texels); iq4_xs one texel of level indices and its
// super-block's uvec2 scales entry (f16 d | 2-bit scale highs, 4-bit scale lows);
// super-block's 16-byte header texel; q6_k a texel of low nibbles, half a texel of 2-bit
// highs, its super-block's int8 scales texel and f16 d word (layouts.py); q2_k half a texel
// of 2-bit "crumbs" (crumbs()) plus its super-block's scale|min texel and f16 d|dmin word;
// q3_k the same crumbs, a word of high bits and its super-block's scales|d texel.
//
// Reduction contract (batch invariance, ARCHITECTURE.md invariant 9): every matmul kernel reduces one
// output as  acc = 0; for each block b in order: p = block_part(w_b, x_b); acc = combine(...)
// with the helpers below, in `precise` arithmetic, so the result never depends on how many
// tokens or rows an invocation handles nor on which kernel (vec / tiled) ran. q6_k, whose
// scales cover 16 values, keeps two partial sums per block (first and second 16 values) and
// combines them in that order. matmul_vec's split-K mode (SPLIT > 1, GPUs) runs this per
// lane over every SPLIT-th block and adds the lanes' sums in a fixed tree; SPLIT is fixed
// per device and K, so that order too is independent of the batch.
// (Measured: writing block_dot as an explicit fma chain instead of precise dot()s was no
// faster on llvmpipe, which compiles fma() to a multiply and an add.)
// Includers enable GL_EXT_control_flow_attributes ([[unroll]]).

#ifndef VKRT_QUANT_GLSL
#define VKRT_QUANT_GLSL

// ---- raw words -> 4 consecutive values --------------------------------------------------
// q4: byte i of a block holds element i (low nibble) and element i + 16 (high nibble), so
// word j's low nibbles are elements 4j..4j+3 and its high nibbles 16+4j..16+4j+3.
vec4 q4_lo(uint w) { return vec4((uvec4(w) >> uvec4(0u, 8u, 16u, 24u)) & 0xFu); }
vec4 q4_hi(uint w) { return vec4((uvec4(w) >> uvec4(4u, 12u, 20u, 28u)) & 0xFu); }
// q8: four signed bytes, element order = byte order (little endian).
vec4 q8_vals(uint w) { return vec4(ivec4(uvec4(w) << uvec4(24u, 16u, 8u, 0u)) >> 24); }
vec4 u8_vals(uint w) { return vec4((uvec4(w) >> uvec4(0u, 8u, 16u, 24u)) & 0xFFu); }
// crumbs (q2_k, q3_k): word h of a sub-block holds element 16h + 4i + c at bits 8c + 2i, so
// shift i gives elements 16h + 4i .. +3 in the four byte lanes.
uint crumbs(uint w, uint i) { return (w >> (2u * i)) & 0x03030303u; }
// Bits 0..3 of `bits` to bit 0 of bytes 0..3 (the four shifted copies do not overlap).
uint spread4(uint bits) { return ((bits & 0xFu) * 0x00204081u) & 0x01010101u; }
vec4 f16_vals(uint a, uint b) { return vec4(unpackHalf2x16(a), unpackHalf2x16(b)); }
vec4 bf16_vals(uint a, uint b) {
    return uintBitsToFloat(uvec4(a << 16, a & 0xFFFF0000u, b << 16, b & 0xFFFF0000u));
}

// ---- one 32-value block -------------------------------------------------------------------
// Weights of one block as 8 vec4 (raw quants for block formats: the scale is applied by
// combine()). Each block-format texel decodes to the same 8 vec4 in element order.
void q4_block(uvec4 t, out vec4 w[8]) {
    w[0] = q4_lo(t.x); w[1] = q4_lo(t.y); w[2] = q4_lo(t.z); w[3] = q4_lo(t.w);
    w[4] = q4_hi(t.x); w[5] = q4_hi(t.y); w[6] = q4_hi(t.z); w[7] = q4_hi(t.w);
}
// q5: q4's nibbles plus bit i of qh as element i's fifth bit: values 0..31.
// Word w of the texel gives elements 4w.. (low nibbles) and 16 + 4w.. (high nibbles).
vec4 q5_vals(uint nibbles, uint qh, uint first) {
    return u8_vals((nibbles & 0x0F0F0F0Fu) | (spread4(qh >> first) << 4));
}
void q5_block(uvec4 t, uint qh, out vec4 w[8]) {
    w[0] = q5_vals(t.x, qh, 0u); w[1] = q5_vals(t.y, qh, 4u); w[2] = q5_vals(t.z, qh, 8u); w[3] = q5_vals(t.w, qh, 12u);
    w[4] = q5_vals(t.x >> 4, qh, 16u); w[5] = q5_vals(t.y >> 4, qh, 20u);
    w[6] = q5_vals(t.z >> 4, qh, 24u); w[7] = q5_vals(t.w >> 4, qh, 28u);
}
// iq4_nl / iq4_xs: q4's nibbles index the 16 non-linear levels of vkrt.core.formats.IQ4_LEVELS
// (-127 ... 113), computed, not looked up: the degree-4 minimax polynomial through them
// (IQ4_POLY, highest power first) is within 0.433 of every level, so rounding it gives each
// level exactly (tests/ops/test_formats.py checks all 16, with and without fma). Measured on
// llvmpipe (docs/BENCHMARKS.md): indexing a const float[16] per value made the iq4_nl
// matvec ~10x slower than q4_0's; computed, it is ~2x (the polynomial is 4 multiply-adds
// and a round per value where q4_0 decodes with a shift and a mask).
const float IQ4_POLY[5] = float[5](0.0015860428, 0.03108644, -1.371927, 24.17383, -126.56701);
vec4 iq4_levels(vec4 q) {
    precise vec4 p = fma(fma(fma(fma(vec4(IQ4_POLY[0]), q, vec4(IQ4_POLY[1])), q, vec4(IQ4_POLY[2])), q,
                             vec4(IQ4_POLY[3])), q, vec4(IQ4_POLY[4]));
    return roundEven(p);
}
float iq4_level(uint i) { return iq4_levels(vec4(float(i))).x; }
vec4 iq4_vals(uint w, uint shift) {
    return iq4_levels(vec4((uvec4(w) >> (uvec4(0u, 8u, 16u, 24u) + shift)) & 0xFu));
}
void iq4_block(uvec4 t, out vec4 w[8]) {
    w[0] = iq4_vals(t.x, 0u); w[1] = iq4_vals(t.y, 0u); w[2] = iq4_vals(t.z, 0u); w[3] = iq4_vals(t.w, 0u);
    w[4] = iq4_vals(t.x, 4u); w[5] = iq4_vals(t.y, 4u); w[6] = iq4_vals(t.z, 4u); w[7] = iq4_vals(t.w, 4u);
}
// mxfp4: q4's nibbles are e2m1 codes, doubled as vkrt.core.formats.MXFP4_LEVELS tabulates them
// (bit 3 the sign; exponent e = bits 1-2, mantissa m = bit 0: m where e is 0, else (2 + m) <<
// (e - 1)), in integers, so the 16 values are exact and +0 where the code is -0; the block's
// E8M0 byte scales them by 2^(e - 128) in combine().
vec4 mxfp4_levels(uvec4 q) {
    uvec4 v = q & 7u, e = v >> 1, m = v & 1u;
    uvec4 mag = mix(m, (2u + m) << (max(e, uvec4(1u)) - 1u), greaterThan(e, uvec4(0u)));
    return vec4(ivec4(mag) * (1 - 2 * ivec4(q >> 3)));
}
float mxfp4_level(uint i) { return mxfp4_levels(uvec4(i)).x; }
vec4 mxfp4_vals(uint w, uint shift) { return mxfp4_levels((uvec4(w) >> (uvec4(0u, 8u, 16u, 24u) + shift)) & 0xFu); }
void mxfp4_block(uvec4 t, out vec4 w[8]) {
    w[0] = mxfp4_vals(t.x, 0u); w[1] = mxfp4_vals(t.y, 0u); w[2] = mxfp4_vals(t.z, 0u); w[3] = mxfp4_vals(t.w, 0u);
    w[4] = mxfp4_vals(t.x, 4u); w[5] = mxfp4_vals(t.y, 4u); w[6] = mxfp4_vals(t.z, 4u); w[7] = mxfp4_vals(t.w, 4u);
}
// The block's scale 2^(e - 128) from its scales word (E8M0 byte e in the low byte), built as f32
// bits (ggml's e8m0 half: subnormal below e = 2).
float mxfp4_scale(uint word) {
    uint e = word & 0xFFu;
    return uintBitsToFloat(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
}
void q8_block(uvec4 a, uvec4 b, out vec4 w[8]) {
    w[0] = q8_vals(a.x); w[1] = q8_vals(a.y); w[2] = q8_vals(a.z); w[3] = q8_vals(a.w);
    w[4] = q8_vals(b.x); w[5] = q8_vals(b.y); w[6] = q8_vals(b.z); w[7] = q8_vals(b.w);
}
void f16_block(uvec4 a, uvec4 b, uvec4 c, uvec4 d, out vec4 w[8]) {
    w[0] = f16_vals(a.x, a.y); w[1] = f16_vals(a.z, a.w); w[2] = f16_vals(b.x, b.y); w[3] = f16_vals(b.z, b.w);
    w[4] = f16_vals(c.x, c.y); w[5] = f16_vals(c.z, c.w); w[6] = f16_vals(d.x, d.y); w[7] = f16_vals(d.z, d.w);
}
void bf16_block(uvec4 a, uvec4 b, uvec4 c, uvec4 d, out vec4 w[8]) {
    w[0] = bf16_vals(a.x, a.y); w[1] = bf16_vals(a.z, a.w); w[2] = bf16_vals(b.x, b.y); w[3] = bf16_vals(b.z, b.w);
    w[4] = bf16_vals(c.x, c.y); w[5] = bf16_vals(c.z, c.w); w[6] = bf16_vals(d.x, d.y); w[7] = bf16_vals(d.z, d.w);
}

// q2_k: 2-bit values 0..3 (the scale and min are applied by combine()).
void q2_block(uvec2 c, out vec4 w[8]) {
    w[0] = u8_vals(crumbs(c.x, 0u)); w[1] = u8_vals(crumbs(c.x, 1u));
    w[2] = u8_vals(crumbs(c.x, 2u)); w[3] = u8_vals(crumbs(c.x, 3u));
    w[4] = u8_vals(crumbs(c.y, 0u)); w[5] = u8_vals(crumbs(c.y, 1u));
    w[6] = u8_vals(crumbs(c.y, 2u)); w[7] = u8_vals(crumbs(c.y, 3u));
}
// q3_k: the crumbs plus a high bit (element 16h + 4i + c's at bit 8c + 4h + i of hw):
// 3-bit values 0..7, so GGUF's "a clear bit subtracts 4" is q - 4, folded in by combine().
vec4 q3_vals(uint c, uint hw, uint i) { return u8_vals(crumbs(c, i) | (((hw >> i) & 0x01010101u) << 2)); }
void q3_block(uvec2 c, uint hw, out vec4 w[8]) {
    w[0] = q3_vals(c.x, hw, 0u); w[1] = q3_vals(c.x, hw, 1u); w[2] = q3_vals(c.x, hw, 2u); w[3] = q3_vals(c.x, hw, 3u);
    w[4] = q3_vals(c.y, hw >> 4, 0u); w[5] = q3_vals(c.y, hw >> 4, 1u);
    w[6] = q3_vals(c.y, hw >> 4, 2u); w[7] = q3_vals(c.y, hw >> 4, 3u);
}

// The fixed in-block order: 8 four-wide dots added left to right.
float block_dot(vec4 w[8], vec4 x[8]) {
    precise float p = dot(w[0], x[0]);
    p += dot(w[1], x[1]); p += dot(w[2], x[2]); p += dot(w[3], x[3]);
    p += dot(w[4], x[4]); p += dot(w[5], x[5]); p += dot(w[6], x[6]); p += dot(w[7], x[7]);
    return p;
}

// Sum of the block's activations: q4_0 / q4_1 fold their offset (-8 / m) into it once per
// block and token instead of once per weight.
float block_sum(vec4 x[8]) {
    const vec4 one = vec4(1.0);
    precise float s = dot(x[0], one);
    s += dot(x[1], one); s += dot(x[2], one); s += dot(x[3], one);
    s += dot(x[4], one); s += dot(x[5], one); s += dot(x[6], one); s += dot(x[7], one);
    return s;
}

// Two 16-value halves (q6_k: one scale each), each in block_dot's order.
vec2 block_dot2(vec4 w[8], vec4 x[8]) {
    precise float a = dot(w[0], x[0]);
    a += dot(w[1], x[1]); a += dot(w[2], x[2]); a += dot(w[3], x[3]);
    precise float b = dot(w[4], x[4]);
    b += dot(w[5], x[5]); b += dot(w[6], x[6]); b += dot(w[7], x[7]);
    return vec2(a, b);
}
vec2 block_sum2(vec4 x[8]) {
    const vec4 one = vec4(1.0);
    precise float a = dot(x[0], one);
    a += dot(x[1], one); a += dot(x[2], one); a += dot(x[3], one);
    precise float b = dot(x[4], one);
    b += dot(x[5], one); b += dot(x[6], one); b += dot(x[7], one);
    return vec2(a, b);
}

// Per-format types: PART_T is a block's partial dot / activation sum (vec2 halves for the
// formats whose scales cover 16 values: q2_k, q3_k, q6_k); SCALE_T what combine() needs of
// the block's scales (the raw word, or for K-quants the f32 products (d*sc, -dmin*m),
// (d*sc_lo, d*sc_hi) or for q2_k (d*sc_lo, d*sc_hi, -dmin*m_lo, -dmin*m_hi)).
#if defined(WFMT_Q6_K) || defined(WFMT_Q2_K) || defined(WFMT_Q3_K)
#define PART_T vec2
#define block_part block_dot2
#define block_xsum block_sum2
#else
#define PART_T float
#define block_part block_dot
#define block_xsum block_sum
#endif

// block_part one vec4 at a time: after steps j = 0..7 in order (the caller unrolls them),
// p is block_part(w, x) bit for bit. For kernels that interleave many outputs' blocks and
// read the eight vec4 of a block one by one (matmul_tiled.comp, from shared memory), or
// advance several tokens' dots together (matmul_vec.comp).
PART_T block_part_step(PART_T p, uint j, vec4 w, vec4 x) {
    precise float d = dot(w, x);
#if defined(WFMT_Q6_K) || defined(WFMT_Q2_K) || defined(WFMT_Q3_K)
    if (j < 4u) {
        precise float a = j == 0u ? d : p.x + d;
        p.x = a;
    } else {
        precise float b = j == 4u ? d : p.y + d;
        p.y = b;
    }
    return p;
#else
    precise float r = j == 0u ? d : p + d;
    return r;
#endif
}
#if defined(WFMT_Q2_K)
#define SCALE_T vec4
#elif defined(WFMT_Q4_K) || defined(WFMT_Q5_K) || defined(WFMT_Q6_K) || defined(WFMT_Q3_K)
#define SCALE_T vec2
#elif defined(WFMT_Q5_0) || defined(WFMT_Q5_1)
#define SCALE_T uvec2
#elif defined(WFMT_IQ4_XS)
#define SCALE_T float
#else
#define SCALE_T uint
#endif

// acc + this block's contribution. `scale` is the block's scales word, p its block_dot and
// xsum its block_sum (unused by formats that have no offset).
float combine(float acc, PART_T p, SCALE_T scale, PART_T xsum) {
    precise float r;
#if defined(WFMT_Q4_K) || defined(WFMT_Q5_K)
    r = fma(scale.y, xsum, fma(scale.x, p, acc));
#elif defined(WFMT_IQ4_XS)
    r = fma(scale, p, acc);
#elif defined(WFMT_Q6_K)
    precise float lo = fma(scale.x, fma(xsum.x, -32.0, p.x), acc);
    r = fma(scale.y, fma(xsum.y, -32.0, p.y), lo);
#elif defined(WFMT_Q3_K)
    precise float lo = fma(scale.x, fma(xsum.x, -4.0, p.x), acc);
    r = fma(scale.y, fma(xsum.y, -4.0, p.y), lo);
#elif defined(WFMT_Q2_K)
    precise float lo = fma(scale.z, xsum.x, fma(scale.x, p.x, acc));
    r = fma(scale.w, xsum.y, fma(scale.y, p.y, lo));
#elif defined(WFMT_Q8_0) || defined(WFMT_IQ4_NL)
    r = fma(unpackHalf2x16(scale).x, p, acc);
#elif defined(WFMT_MXFP4)
    r = fma(mxfp4_scale(scale), p, acc);
#elif defined(WFMT_Q4_0)
    r = fma(unpackHalf2x16(scale).x, fma(xsum, -8.0, p), acc);
#elif defined(WFMT_Q5_0)
    r = fma(unpackHalf2x16(scale.x).x, fma(xsum, -16.0, p), acc);
#elif defined(WFMT_Q4_1)
    vec2 dm = unpackHalf2x16(scale);
    r = fma(dm.y, xsum, fma(dm.x, p, acc));
#elif defined(WFMT_Q5_1)
    vec2 dm = unpackHalf2x16(scale.x);
    r = fma(dm.y, xsum, fma(dm.x, p, acc));
#else
    r = acc + p;
#endif
    return r;
}

#if defined(WFMT_Q4_0) || defined(WFMT_Q4_1) || defined(WFMT_Q5_0) || defined(WFMT_Q5_1) || \
    defined(WFMT_Q4_K) || defined(WFMT_Q5_K) || defined(WFMT_Q6_K) || defined(WFMT_Q2_K) || defined(WFMT_Q3_K)
#define NEEDS_XSUM 1
#endif
#if !defined(WFMT_F32) && !defined(WFMT_F16) && !defined(WFMT_BF16)
// Block formats need K % 32 == 0, so no activation block is partial and load_x needs no
// bounds branch (llvmpipe runs both sides of a branch under a mask: that branch had doubled
// the activation fetches and spilled them through masked stores).
#define WHOLE_BLOCKS 1
#endif

// q4_k: sub-block s's (d*sc, -dmin*m) from its super-block's header texel (f16 d, f16 dmin,
// then GGUF's 12 bytes of 6-bit scales and mins; the unpacking of vkrt.core.quant).
vec2 q4_k_scale(uvec4 h, uint s) {
    uint sh = 8u * (s & 3u);
    uint a = (h.y >> sh) & 0xFFu, m = (h.z >> sh) & 0xFFu, c = (h.w >> sh) & 0xFFu;
    uint sc = s < 4u ? a & 63u : (c & 0xFu) | ((a >> 6) << 4);
    uint mn = s < 4u ? m & 63u : (c >> 4) | ((m >> 6) << 4);
    vec2 dm = unpackHalf2x16(h.x);
    precise vec2 r = vec2(dm.x * float(sc), -(dm.y * float(mn)));
    return r;
}
// iq4_xs: sub-block s's d * (sc - 32) from its super-block's entry: e.x = f16 d | the 2-bit
// scale highs (2s..2s+1 of the high half), e.y = the 4-bit scale lows (bits 4s..4s+3).
float iq4_xs_scale(uvec2 e, uint s) {
    int sc = int(((e.y >> (4u * s)) & 0xFu) | (((e.x >> (16u + 2u * s)) & 3u) << 4)) - 32;
    precise float r = unpackHalf2x16(e.x).x * float(sc);
    return r;
}
// q6_k: sub-block s's (d*sc_lo, d*sc_hi) from the super-block's 16 int8 scales.
vec2 q6_k_scale(uvec4 scales, uint s, float d) {
    uint w = scales[s >> 1];
    uint sh = 16u * (s & 1u);
    precise vec2 r = vec2(d * float(int(w << (24u - sh)) >> 24), d * float(int(w << (16u - sh)) >> 24));
    return r;
}

// q2_k: sub-block s's (d*sc, d*sc', -dmin*m, -dmin*m') for its two 16-value groups 2s and
// 2s + 1, from the super-block's 16 scale|min bytes (scale low nibble, min high) and dm =
// (d, dmin).
vec4 q2_k_scale(uvec4 sm, uint s, vec2 dm) {
    uint w = sm[s >> 1] >> (16u * (s & 1u));
    uvec4 v = (uvec4(w) >> uvec4(0u, 8u, 4u, 12u)) & 0xFu;  // sc, sc', m, m'
    precise vec4 r = vec4(dm.x * float(v.x), dm.x * float(v.y), -(dm.y * float(v.z)), -(dm.y * float(v.w)));
    return r;
}
// q3_k: scale j of the super-block's texel h (GGUF's 12 bytes of 6-bit scales, then f16 d):
// low 4 bits in byte j % 8 (high nibble for j >= 8), top 2 at bit 2 (j / 4) of byte 8 + j % 4.
int q3_k_sc(uvec4 h, uint j) {
    uint lo = (h[(j >> 2) & 1u] >> (8u * (j & 3u) + 4u * (j >> 3))) & 0xFu;
    uint hi = (h.z >> (8u * (j & 3u) + 2u * (j >> 2))) & 3u;
    return int(lo | (hi << 4)) - 32;
}
// q3_k: sub-block s's (d*sc_lo, d*sc_hi) (groups 2s, 2s + 1).
vec2 q3_k_scale(uvec4 h, uint s) {
    float d = unpackHalf2x16(h.w).x;
    precise vec2 r = vec2(d * float(q3_k_sc(h, 2u * s)), d * float(q3_k_sc(h, 2u * s + 1u)));
    return r;
}

// ---- matmul operand loaders (define MATMUL_IO before including) --------------------------
// load_block(texel) decodes the block starting at quants texel `texel` of binding `wq`
// (IN_F32X4 for f32, IN_U32X4 otherwise); load_x reads 32 activations of binding `x`
// (IN_F32). Both bindings are declared by the including shader.
#ifdef MATMUL_IO
#if defined(WFMT_F32)
#define BLOCK_TEXELS 8u
void load_block(uint i, out vec4 w[8]) {
    w[0] = LD_F32X4(wq, i); w[1] = LD_F32X4(wq, i + 1u); w[2] = LD_F32X4(wq, i + 2u); w[3] = LD_F32X4(wq, i + 3u);
    w[4] = LD_F32X4(wq, i + 4u); w[5] = LD_F32X4(wq, i + 5u); w[6] = LD_F32X4(wq, i + 6u); w[7] = LD_F32X4(wq, i + 7u);
}
#elif defined(WFMT_F16)
#define BLOCK_TEXELS 4u
void load_block(uint i, out vec4 w[8]) {
    f16_block(LD_U32X4(wq, i), LD_U32X4(wq, i + 1u), LD_U32X4(wq, i + 2u), LD_U32X4(wq, i + 3u), w);
}
#elif defined(WFMT_BF16)
#define BLOCK_TEXELS 4u
void load_block(uint i, out vec4 w[8]) {
    bf16_block(LD_U32X4(wq, i), LD_U32X4(wq, i + 1u), LD_U32X4(wq, i + 2u), LD_U32X4(wq, i + 3u), w);
}
#elif defined(WFMT_Q8_0)
#define BLOCK_TEXELS 2u
void load_block(uint i, out vec4 w[8]) { q8_block(LD_U32X4(wq, i), LD_U32X4(wq, i + 1u), w); }
#elif defined(WFMT_IQ4_NL)
#define BLOCK_TEXELS 1u
void load_block(uint i, out vec4 w[8]) { iq4_block(LD_U32X4(wq, i), w); }
#elif defined(WFMT_MXFP4)
#define BLOCK_TEXELS 1u
void load_block(uint i, out vec4 w[8]) { mxfp4_block(LD_U32X4(wq, i), w); }
#elif defined(WFMT_Q6_K)
// Low nibbles in q4 order; hw holds the 2-bit highs (layouts.py): 6-bit values 0..63.
void q6_block(uvec4 lo, uvec2 hw, out vec4 w[8]) {
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        uint h = (hw[i >> 1] >> (4u * (i & 1u))) & 0x0F0F0F0Fu;
        w[i] = u8_vals((lo[i] & 0x0F0F0F0Fu) | ((h & 0x03030303u) << 4));
        w[4u + i] = u8_vals(((lo[i] >> 4) & 0x0F0F0F0Fu) | ((h & 0x0C0C0C0Cu) << 2));
    }
}
#elif defined(WFMT_IQ4_XS)
#define BLOCK_TEXELS 1u
void load_block(uint i, out vec4 w[8]) { iq4_block(LD_U32X4(wq, i), w); }
#elif defined(WFMT_Q2_K) || defined(WFMT_Q3_K)
// load_wblock reads them per super-block
#else
#define BLOCK_TEXELS 1u
void load_block(uint i, out vec4 w[8]) { q4_block(LD_U32X4(wq, i), w); }
#endif

#include "tiles.glsl"
#ifdef WFMT_Q6_K
#define UNIT_TEXELS 12u  // quants texels per q6_k super-block
#elif defined(WFMT_Q2_K)
#define UNIT_TEXELS 4u  // crumb texels per q2_k super-block
#elif defined(WFMT_Q3_K)
#define UNIT_TEXELS 6u  // 4 crumb texels and 2 of high bits per q3_k super-block
#elif defined(WFMT_Q5_K)
#define UNIT_TEXELS 10u  // 8 nibble texels and 2 of fifth bits per q5_k super-block
#else
#define UNIT_TEXELS BLOCK_TEXELS
#endif

// Texel of row n's first unit in the quants region (w_row: quants texels per row).
uint row_base(uint n, uint w_row) {
    return tiled(n, w_row / UNIT_TEXELS, 0u, UNIT_TEXELS);
}

// Where row n's scales start: .x for the scales words / header texels, .y q6_k's d words
// (q2_k's d|dmin words).
// s_base: first scales word (u32 units, 16-byte aligned); blocks: 32-value blocks per row;
// N: the weight's rows (its scales regions hold them padded to whole tiles).
uvec2 row_scales(uint n, uint s_base, uint blocks, uint N) {
#if defined(WFMT_Q4_K) || defined(WFMT_Q5_K) || defined(WFMT_Q6_K) || defined(WFMT_Q2_K) || defined(WFMT_Q3_K)
    uint supers = blocks >> 3;
    uint first = tiled(n, supers, 0u, 1u);  // (n, super-block 0), in units
    uint padded = (N + TILE - 1u) / TILE * TILE;
    return uvec2((s_base >> 2) + first, s_base + padded * supers * 4u + first);
#elif defined(WFMT_IQ4_XS)
    return uvec2((s_base >> 1) + tiled(n, blocks >> 3, 0u, 1u), 0u);  // in uvec2 entries
#elif defined(WFMT_Q5_0) || defined(WFMT_Q5_1)
    return uvec2((s_base >> 1) + tiled(n, blocks, 0u, 1u), 0u);  // in uvec2 entries
#else
    return uvec2(s_base + tiled(n, blocks, 0u, 1u), 0u);
#endif
}

// Block b's scales for combine() (rs from row_scales).
SCALE_T load_scale(uvec2 rs, uint b) {
#if defined(WFMT_Q4_K) || defined(WFMT_Q5_K)
    return q4_k_scale(LD_U32X4(wq, rs.x + (b >> 3) * TILE), b & 7u);
#elif defined(WFMT_Q3_K)
    return q3_k_scale(LD_U32X4(wq, rs.x + (b >> 3) * TILE), b & 7u);
#elif defined(WFMT_Q2_K)
    uint sup = (b >> 3) * TILE;
    return q2_k_scale(LD_U32X4(wq, rs.x + sup), b & 7u, unpackHalf2x16(LD_U32(ws, rs.y + sup)));
#elif defined(WFMT_IQ4_XS)
    return iq4_xs_scale(LD_U32X2(ws, rs.x + (b >> 3) * TILE), b & 7u);
#elif defined(WFMT_Q6_K)
    uint sup = (b >> 3) * TILE;
    return q6_k_scale(LD_U32X4(wq, rs.x + sup), b & 7u, unpackHalf2x16(LD_U32(ws, rs.y + sup)).x);
#elif defined(WFMT_Q5_0) || defined(WFMT_Q5_1)
    return LD_U32X2(ws, rs.x + b * TILE);
#elif defined(HAS_SCALES)
    return LD_U32(ws, rs.x + b * TILE);
#else
    return 0u;
#endif
}

// Block b of the row whose quants start at texel `wbase` (row_base; every format); `scale`
// is load_scale's entry of the block (q5's fifth bits are in it).
void load_wblock(uint wbase, uint b, SCALE_T scale, out vec4 w[8]) {
#if defined(WFMT_Q5_0) || defined(WFMT_Q5_1)
    q5_block(LD_U32X4(wq, wbase + b * TILE), scale.y, w);
#elif defined(WFMT_Q5_K)
    uint sb = wbase + (b >> 3) * (TILE * 10u), s = b & 7u;
    q5_block(LD_U32X4(wq, sb + s), LD_U32X4(wq, sb + 8u + (s >> 2))[s & 3u], w);
#elif defined(WFMT_Q6_K)
    uint sb = wbase + (b >> 3) * (TILE * 12u), s = b & 7u;
    uvec4 hi = LD_U32X4(wq, sb + 8u + (s >> 1));
    q6_block(LD_U32X4(wq, sb + s), (s & 1u) == 0u ? hi.xy : hi.zw, w);
#elif defined(WFMT_Q2_K)
    uint s = b & 7u;
    uvec4 c = LD_U32X4(wq, wbase + (b >> 3) * (TILE * 4u) + (s >> 1));
    q2_block((s & 1u) == 0u ? c.xy : c.zw, w);
#elif defined(WFMT_Q3_K)
    uint sb = wbase + (b >> 3) * (TILE * 6u), s = b & 7u;
    uvec4 c = LD_U32X4(wq, sb + (s >> 1));
    q3_block((s & 1u) == 0u ? c.xy : c.zw, LD_U32X4(wq, sb + 4u + (s >> 2))[s & 3u], w);
#else
    load_block(wbase + b * (TILE * BLOCK_TEXELS), w);
#endif
}

// x is bound as RGBA32F texels when its rows are whole texels (K % 4 == 0, texel path) and
// as R32F / a float[] otherwise: a spec constant, so each pipeline keeps one load path.
layout(constant_id = 2) const bool X_VEC4 = false;

// The 32 activations of block b of token t, zero past K (only a float row's last block is
// partial: block formats need K % 32 == 0).
void load_x(uint t, uint b, uint K, out vec4 xv[8]) {
    uint k0 = b * 32u;
    uint base = t * K + k0;
#ifdef ACCESS_TEXEL
    if (X_VEC4) {
        base >>= 2;
#ifdef WHOLE_BLOCKS
        [[unroll]] for (uint j = 0u; j < 8u; j++) xv[j] = LD_F32X4(x, base + j);
        return;
#endif
        if (k0 + 32u <= K) {
            [[unroll]] for (uint j = 0u; j < 8u; j++) xv[j] = LD_F32X4(x, base + j);
        } else {
            [[unroll]] for (uint j = 0u; j < 8u; j++) xv[j] = k0 + 4u * j < K ? LD_F32X4(x, base + j) : vec4(0.0);
        }
        return;
    }
#endif
    if (k0 + 32u <= K) {
        [[unroll]] for (uint j = 0u; j < 8u; j++) {
            uint i = base + 4u * j;
            xv[j] = vec4(LD_F32(x, i), LD_F32(x, i + 1u), LD_F32(x, i + 2u), LD_F32(x, i + 3u));
        }
    } else {
        [[unroll]] for (uint j = 0u; j < 8u; j++) {
            [[unroll]] for (uint c = 0u; c < 4u; c++) {
                uint k = k0 + 4u * j + c;
                xv[j][c] = k < K ? LD_F32(x, base + 4u * j + c) : 0.0;
            }
        }
    }
}

#ifdef MATMUL_NORM_W
// Block b of the norm weight (binding norm_w, which the including shader declares when it
// defines MATMUL_NORM_W; read like x: texels when X_VEC4), 0 past K.
void load_norm_weight(uint b, uint K, out vec4 gv[8]) {
    uint k0 = b * 32u;
#ifdef ACCESS_TEXEL
    if (X_VEC4) {
#ifdef WHOLE_BLOCKS
        [[unroll]] for (uint j = 0u; j < 8u; j++) gv[j] = LD_F32X4(norm_w, (k0 >> 2) + j);
#else
        [[unroll]] for (uint j = 0u; j < 8u; j++) gv[j] = k0 + 4u * j < K ? LD_F32X4(norm_w, (k0 >> 2) + j) : vec4(0.0);
#endif
        return;
    }
#endif
    [[unroll]] for (uint j = 0u; j < 8u; j++) {
        [[unroll]] for (uint c = 0u; c < 4u; c++) {
            uint k = k0 + 4u * j + c;
            gv[j][c] = k < K ? LD_F32(norm_w, k) : 0.0;
        }
    }
}
#endif
#endif  // MATMUL_IO
#endif  // VKRT_QUANT_GLSL
