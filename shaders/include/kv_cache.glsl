// The paged key / value caches, bindings 1 and 2, in the format of the KV_* define, and
// LOAD_ROW(cache, dst, row): the key or value row that starts at 4-value texel `row` into the
// vec4 array dst[HD4] (k_row or v_row, which the including shader declares; include/
// attention.glsl's attend_position loads them).
//   KV_F32:  4 floats per texel.
//   KV_F16:  4 halves per u32x2 texel, or with KV_F16_WIDE 8 halves per u32x4 texel (half the
//            fetches; the host binds that view, which needs head_dim a multiple of 8).
//   KV_Q8_0: GGUF Q8_0 blocks as words (include/codecs.glsl); a texel is the 4 values of one
//            quant word, and a row reads each block's scale word once.
#if defined(KV_F16) && defined(KV_F16_WIDE)
IN_U32X4(1, k_cache);
IN_U32X4(2, v_cache);
#define LOAD_ROW(cache, dst, row) \
    [[unroll]] for (uint d = 0u; d < HD4 / 2u; ++d) { \
        uvec4 w = LD_U32X4(cache, (row) / 2u + d); \
        dst[2u * d] = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); \
        dst[2u * d + 1u] = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w)); \
    }
#elif defined(KV_F16)
IN_U32X2(1, k_cache);
IN_U32X2(2, v_cache);
#define LOAD_ROW(cache, dst, row) \
    [[unroll]] for (uint d = 0u; d < HD4; ++d) { \
        uvec2 w = LD_U32X2(cache, (row) + d); \
        dst[d] = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); \
    }
#elif defined(KV_Q8_0)
#include "codecs.glsl"
IN_U32(1, k_cache);
IN_U32(2, v_cache);
// Per 32-value block of the row (head_dim is a multiple of 32, so rows start on blocks): its
// scale word once, then its 8 quant words (q8_0_values' arithmetic, so LD_Q8_0's values).
#define LOAD_ROW(cache, dst, row) \
    [[unroll]] for (uint b = 0u; b < HD4 / 8u; ++b) { \
        uint e = 4u * ((row) + 8u * b); \
        uint scales = LD_U32(cache, q8_0_scale_word(e)); \
        [[unroll]] for (uint j = 0u; j < 8u; ++j) \
            dst[8u * b + j] = q8_0_values(LD_U32(cache, q8_0_quant_word(e + 4u * j)), scales, q8_0_scale_shift(e)); \
    }
#else
IN_F32X4(1, k_cache);
IN_F32X4(2, v_cache);
#define LOAD_ROW(cache, dst, row) [[unroll]] for (uint d = 0u; d < HD4; ++d) dst[d] = LD_F32X4(cache, (row) + d)
#endif
