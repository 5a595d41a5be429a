#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: WFMT=f32,f16,bf16,q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_xs,mxfp4 ACCESS=texel,ssbo
// Embedding gather: y[t, d] = dequant(table[ids[t], d]), one invocation per output value,
// reading the weight device layout (layouts.py) through one 32-bit view of the table.
// Bit-exact with the numpy reference: values are rebuilt as d * q (+ m) in separate,
// uncontracted f32 operations (`precise`), the order vkrt/core/quant.py computes them in.
#include "access.glsl"
DECLARE_LOCAL_SIZE;

#ifdef WFMT_F32
IN_F32(0, table);
#else
IN_U32(0, table);
#endif
IN_I32(1, ids);
OUT_F32(2, y);

// blocks: 32-value blocks per row (a float row's last one padded); s_base: first scales
// word; d_base: q6_k's first d word, q2_k's first d|dmin word (layouts.py).
layout(push_constant) uniform Push { uint n; uint D; uint blocks; uint s_base; uint d_base; } pc;

#include "tiles.glsl"  // the table is row-tiled; offsets below are in 32-bit words
#include "quant.glsl"  // iq4_level, q3_k_sc

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.n) return;
    uint row = uint(LD_I32(ids, i / pc.D));
    uint d = i % pc.D;
    precise float v;
#if defined(WFMT_F32)
    v = LD_F32(table, tiled(row, pc.blocks, d / 32u, 32u) + d % 32u);
#elif defined(WFMT_F16) || defined(WFMT_BF16)
    uint w = LD_U32(table, tiled(row, pc.blocks, d / 32u, 16u) + (d % 32u) / 2u);
#ifdef WFMT_F16
    v = unpackHalf2x16(w)[d & 1u];
#else
    v = uintBitsToFloat((d & 1u) == 0u ? w << 16 : w & 0xFFFF0000u);
#endif
#elif defined(WFMT_Q2_K) || defined(WFMT_Q3_K)
    // Element e of sub-block s: the crumb at bits 8c + 2i of word 16h.. (e = 16h + 4i + c),
    // q3_k's high bit at 8c + 4h + i of the sub-block's high word; 16-value group g = 2s + h.
    // value = (d * sc) * q - dmin * m (q2_k) or (d * (sc - 32)) * (q - 4) (q3_k).
    uint blk = d / 32u, e = d % 32u, s = blk % 8u, supers = pc.blocks / 8u, sup = blk / 8u;
    uint h = e / 16u, i4 = (e / 4u) % 4u, c = e % 4u, g = 2u * s + h;
#ifdef WFMT_Q2_K
    uint base = tiled(row, supers, sup, 16u);  // 4 crumb texels per super-block
    float q = float((LD_U32(table, base + 2u * s + h) >> (8u * c + 2u * i4)) & 3u);
    uint sm = (LD_U32(table, pc.s_base + tiled(row, supers, sup, 4u) + g / 4u) >> (8u * (g % 4u))) & 0xFFu;
    vec2 dm = unpackHalf2x16(LD_U32(table, pc.d_base + tiled(row, supers, sup, 1u)));
    precise float ds = dm.x * float(sm & 0xFu);
    precise float dmn = dm.y * float(sm >> 4);
    v = ds * q - dmn;
#else
    uint base = tiled(row, supers, sup, 24u);  // 4 crumb texels, 2 of high bits per super-block
    uint crumb = (LD_U32(table, base + 2u * s + h) >> (8u * c + 2u * i4)) & 3u;
    uint high = (LD_U32(table, base + 16u + s) >> (8u * c + 4u * h + i4)) & 1u;
    uint header = pc.s_base + tiled(row, supers, sup, 4u);  // 12 scale bytes, f16 d
    uvec4 hd = uvec4(LD_U32(table, header), LD_U32(table, header + 1u), LD_U32(table, header + 2u),
                     LD_U32(table, header + 3u));
    precise float ds = unpackHalf2x16(hd.w).x * float(q3_k_sc(hd, g));
    v = ds * float(int(crumb | (high << 2)) - 4);
#endif
#elif defined(WFMT_Q4_K) || defined(WFMT_Q5_K) || defined(WFMT_Q6_K) || defined(WFMT_IQ4_XS)
    // Sub-block blk of super-block blk / 8: low nibbles in q4 order (byte e % 16, high
    // nibble for e >= 16); value = (d * sc) * q - dmin * m (q4_k, q5_k), (d * sc) * (q - 32)
    // (q6_k) or (d * (sc - 32)) * level (iq4_xs).
    uint blk = d / 32u, e = d % 32u, s = blk % 8u, supers = pc.blocks / 8u, sup = blk / 8u;
    uint j = e % 16u, half_ = e / 16u;
#if defined(WFMT_IQ4_XS)
    uint w = LD_U32(table, tiled(row, pc.blocks, blk, 4u) + j / 4u);
    uint nibble = (w >> (8u * (j % 4u) + 4u * half_)) & 0xFu;
    uint entry = pc.s_base + tiled(row, supers, sup, 2u);  // (f16 d | scale highs, scale lows)
    uint e0 = LD_U32(table, entry), e1 = LD_U32(table, entry + 1u);
    int sc = int(((e1 >> (4u * s)) & 0xFu) | (((e0 >> (16u + 2u * s)) & 3u) << 4)) - 32;
    precise float dl = unpackHalf2x16(e0).x * float(sc);
    v = dl * iq4_level(nibble);
#elif defined(WFMT_Q4_K) || defined(WFMT_Q5_K)
#ifdef WFMT_Q4_K
    uint w = LD_U32(table, tiled(row, pc.blocks, blk, 4u) + j / 4u);
    float q = float((w >> (8u * (j % 4u) + 4u * half_)) & 0xFu);
#else
    uint base = tiled(row, supers, sup, 40u);  // 10 texels per super-block: nibbles, fifth bits
    uint w = LD_U32(table, base + s * 4u + j / 4u);
    uint qh = LD_U32(table, base + 32u + s);
    float q = float(((w >> (8u * (j % 4u) + 4u * half_)) & 0xFu) | (((qh >> e) & 1u) << 4));
#endif
    uint h[4];
    uint header = pc.s_base + tiled(row, supers, sup, 4u);
    for (uint k = 0u; k < 4u; k++) h[k] = LD_U32(table, header + k);
    uint sh = 8u * (s & 3u);
    uint a = (h[1] >> sh) & 0xFFu, m = (h[2] >> sh) & 0xFFu, c = (h[3] >> sh) & 0xFFu;
    uint sc = s < 4u ? a & 63u : (c & 0xFu) | ((a >> 6) << 4);
    uint mn = s < 4u ? m & 63u : (c >> 4) | ((m >> 6) << 4);
    vec2 dm = unpackHalf2x16(h[0]);
    precise float ds = dm.x * float(sc);
    precise float dmn = dm.y * float(mn);
    v = ds * q - dmn;
#else
    uint base = tiled(row, supers, sup, 48u);  // 12 texels per super-block
    uint lo = LD_U32(table, base + s * 4u + j / 4u);
    uint grp = j / 4u, c = j % 4u;
    uint hw = LD_U32(table, base + 32u + s * 2u + grp / 2u);
    uint q6 = ((lo >> (8u * c + 4u * half_)) & 0xFu) | (((hw >> (8u * c + 4u * (grp & 1u) + 2u * half_)) & 3u) << 4);
    uint g = 2u * s + half_;  // the 16-value group's int8 scale
    int sc = int(LD_U32(table, pc.s_base + tiled(row, supers, sup, 4u) + g / 4u) << (24u - 8u * (g % 4u))) >> 24;
    float dd = unpackHalf2x16(LD_U32(table, pc.d_base + tiled(row, supers, sup, 1u))).x;
    precise float ds = dd * float(sc);
    v = ds * (float(q6) - 32.0);
#endif
#else
    uint blk = d / 32u, e = d % 32u;
#if defined(WFMT_Q5_0) || defined(WFMT_Q5_1)
    uint entry = pc.s_base + tiled(row, pc.blocks, blk, 2u);  // (d or d|m, fifth bits)
    vec2 dm = unpackHalf2x16(LD_U32(table, entry));
#else
    uint scale_word = LD_U32(table, pc.s_base + tiled(row, pc.blocks, blk, 1u));
    vec2 dm = unpackHalf2x16(scale_word);
#endif
#if defined(WFMT_Q8_0)
    uint base = tiled(row, pc.blocks, blk, 8u);  // 32 int8 quants = 8 words
    uint w = LD_U32(table, base + e / 4u);
    float q = float(int(w << (24u - 8u * (e % 4u))) >> 24);
    v = dm.x * q;
#else
    uint base = tiled(row, pc.blocks, blk, 4u);  // 32 nibbles = 4 words
    uint byte_index = e % 16u;
    uint w = LD_U32(table, base + byte_index / 4u);
    uint nibble = (w >> (8u * (byte_index % 4u) + (e >= 16u ? 4u : 0u))) & 0xFu;
#if defined(WFMT_Q5_0) || defined(WFMT_Q5_1)
    float q = float(nibble | (((LD_U32(table, entry + 1u) >> e) & 1u) << 4));
#else
    float q = float(nibble);
#endif
#if defined(WFMT_Q4_0)
    v = dm.x * (q - 8.0);
#elif defined(WFMT_Q5_0)
    v = dm.x * (q - 16.0);
#elif defined(WFMT_IQ4_NL)
    v = dm.x * iq4_level(nibble);
#elif defined(WFMT_MXFP4)
    v = mxfp4_scale(scale_word) * mxfp4_level(nibble);
#else
    v = dm.x * q + dm.y;
#endif
#endif
#endif
    y[i] = v;
}
