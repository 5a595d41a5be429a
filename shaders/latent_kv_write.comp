#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: KV=f32,f16,q8_0 ACCESS=texel,ssbo
// Multi-head latent attention's cache write: of token t's kv_a row [latent, k_rope] (kv_a_proj_with_mqa's
// output), the row [rope(k_rope), rms_norm(latent) * w] stored at cache slot slots[t] (< 0: padding),
// one workgroup of ROW_LANES lanes per token. The
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
IN_F32(1, kv_a);
IN_F32(2, w);
IN_I32(3, positions);
IN_F32(4, cos_sin);
IN_I32(5, slots);

// rank: the latent's width; rot_dim: k_rope's (all of it rotates); a row of kv_a and of the cache
// is rank + rot_dim wide.
layout(push_constant) uniform Push {
    uint tokens; uint rank; uint rot_dim; uint max_positions; float eps; uint interleaved;
} pc;

#define ROPE_LOAD(i, d) LD_F32(kv_a, i)
#include "rope.glsl"

#if defined(KV_F16)
#include "cast.glsl"
uint f32_to_f16(float f) { return f32_bits_to_f16_bits(floatBitsToUint(f)); }
#elif defined(KV_Q8_0)
#include "codecs.glsl"
#endif

// Value j of token t's cache row at position p (kv_a's row starting at `src`), the latent scaled
// by its 1 / rms `inv`.
float row_value(uint src, uint j, uint p, float inv) {
    if (j < pc.rot_dim) return rope_element(src + pc.rank + j, j, p, pc.rot_dim, pc.interleaved != 0u);
    uint r = j - pc.rot_dim;
    return LD_F32(kv_a, src + r) * inv * LD_F32(w, r);
}

void main() {
    uint t = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (t >= pc.tokens) return;  // the whole workgroup leaves: no barrier is skipped by half of it
    int slot = LD_I32(slots, t);
    if (slot < 0) return;  // (uniform over the workgroup too)
    uint lane = gl_LocalInvocationID.x;
    uint width = pc.rot_dim + pc.rank;
    uint src = t * width;
    float sq = 0.0;
    for (uint r = lane; r < pc.rank; r += ROW_LANES) {
        float v = LD_F32(kv_a, src + r);
        sq += v * v;
    }
    float inv = 1.0 / sqrt(workgroup_sum(sq) / float(pc.rank) + pc.eps);
    uint p = rope_position(t, pc.max_positions);
    uint base = uint(slot) * width;
#if defined(KV_F16)
    for (uint k = lane; k < width / 2u; k += ROW_LANES)
        cache[base / 2u + k] = f32_to_f16(row_value(src, 2u * k, p, inv))
                               | (f32_to_f16(row_value(src, 2u * k + 1u, p, inv)) << 16);
#elif defined(KV_Q8_0)
    for (uint b = lane; b < width / 32u; b += ROW_LANES) {
        float x[32];
        for (uint j = 0u; j < 32u; ++j) x[j] = row_value(src, 32u * b + j, p, inv);
        STORE_Q8_0(cache, base + 32u * b, x);
    }
#else
    for (uint j = lane; j < width; j += ROW_LANES) cache[base + j] = row_value(src, j, p, inv);
#endif
}
