#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: KV=f32,f16,q8_0 ACCESS=texel,ssbo
// Multi-head latent attention's cache write: token t's row [rope(k_rope[t]), rms_norm(latent[t]) * w]
// stored at cache slot slots[t] (< 0: padding), one workgroup of ROW_LANES lanes per token. The
// norm is norm.comp's rms (the same reduction, the same expressions), the rotation
// include/rope.glsl's and each value is stored as kv_write.comp stores it, so a row's bytes equal
// those of rope, rms_norm, concat_columns and kv_write run one after another.
//   f32: a lane per value; f16: per u32 word, two values (the row width is even, so a row is
//   whole words); q8_0: per 32-value block (rows are whole block pairs).
#include "access.glsl"
#include "reduce.glsl"
DECLARE_LOCAL_SIZE;

#if defined(KV_F16) || defined(KV_Q8_0)
RW_U32(0, cache);
#else
OUT_F32(0, cache);
#endif
IN_F32(1, latent);
IN_F32(2, k_rope);
IN_F32(3, w);
IN_I32(4, positions);
IN_F32(5, cos_sin);
IN_I32(6, slots);

// rank: the latent's width; rot_dim: k_rope's (all of it rotates), the row being rot_dim + rank.
layout(push_constant) uniform Push {
    uint tokens; uint rank; uint rot_dim; uint max_positions; float eps; uint interleaved;
} pc;

#define ROPE_LOAD(i, d) LD_F32(k_rope, i)
#include "rope.glsl"

#if defined(KV_F16)
#include "cast.glsl"
uint f32_to_f16(float f) { return f32_bits_to_f16_bits(floatBitsToUint(f)); }
#elif defined(KV_Q8_0)
#include "codecs.glsl"
#endif

// Value j of token t's row at position p, the latent scaled by its 1 / rms `inv`.
float row_value(uint t, uint j, uint p, float inv) {
    if (j < pc.rot_dim) return rope_element(t * pc.rot_dim + j, j, p, pc.rot_dim, pc.interleaved != 0u);
    uint r = j - pc.rot_dim;
    return LD_F32(latent, t * pc.rank + r) * inv * LD_F32(w, r);
}

void main() {
    uint t = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (t >= pc.tokens) return;  // the whole workgroup leaves: no barrier is skipped by half of it
    int slot = LD_I32(slots, t);
    if (slot < 0) return;  // (uniform over the workgroup too)
    uint lane = gl_LocalInvocationID.x;
    float sq = 0.0;
    for (uint r = lane; r < pc.rank; r += ROW_LANES) {
        float v = LD_F32(latent, t * pc.rank + r);
        sq += v * v;
    }
    float inv = 1.0 / sqrt(workgroup_sum(sq) / float(pc.rank) + pc.eps);
    uint p = rope_position(t, pc.max_positions);
    uint width = pc.rot_dim + pc.rank;
    uint base = uint(slot) * width;
#if defined(KV_F16)
    for (uint k = lane; k < width / 2u; k += ROW_LANES)
        cache[base / 2u + k] = f32_to_f16(row_value(t, 2u * k, p, inv))
                               | (f32_to_f16(row_value(t, 2u * k + 1u, p, inv)) << 16);
#elif defined(KV_Q8_0)
    for (uint b = lane; b < width / 32u; b += ROW_LANES) {
        float x[32];
        for (uint j = 0u; j < 32u; ++j) x[j] = row_value(t, 32u * b + j, p, inv);
        STORE_Q8_0(cache, base + 32u * b, x);
    }
#else
    for (uint j = lane; j < width; j += ROW_LANES) cache[base + j] = row_value(t, j, p, inv);
#endif
}
