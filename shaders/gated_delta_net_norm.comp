#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// The chunked gated delta rule's first pass (vkrt/ops/recurrent.py, gated_delta_net_chunked):
// one invocation per (token, q or k head) writes that head's row L2-normalised, q's also scaled
// by 1 / sqrt(dk), with the recurrent kernel's arithmetic, so the two later passes read each
// normalised row instead of every state column normalising it again.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint DK = 128;  // key head dim, at most 256

IN_F32(0, qkv);  // [T, 2 * Hk * DK + Hv * dv]: q, k, v
OUT_F32(1, qk);  // [T, 2 * Hk, DK]: normalised q heads, then k heads

layout(push_constant) uniform Push { uint tokens; uint k_heads; uint v_width; } pc;

const float L2_EPS = 1e-6;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint rows = 2u * pc.k_heads;
    if (i >= pc.tokens * rows) return;
    uint t = i / rows, r = i % rows;
    uint src = t * (rows * DK + pc.v_width) + r * DK;
    float x[256];
    float sq = 0.0;
    [[unroll]] for (uint d = 0u; d < DK; ++d) {
        x[d] = LD_F32(qkv, src + d);
        sq += x[d] * x[d];
    }
    float scale = 1.0 / sqrt(sq + L2_EPS) * (r < pc.k_heads ? 1.0 / sqrt(float(DK)) : 1.0);
    [[unroll]] for (uint d = 0u; d < DK; ++d) qk[i * DK + d] = x[d] * scale;
}
