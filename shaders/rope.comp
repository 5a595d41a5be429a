#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: ACCESS=texel,ssbo
// Rotary embedding of x [T, heads * head_dim], one invocation per output element.
// The first rot_dim dims of each head rotate by the angles of the token's position; the
// rest pass through (partial rotary). Pairs are (j, j + rot_dim/2) for NeoX / rotate-half,
// (2j, 2j + 1) when interleaved (GPT-J). cos_sin [P, rot_dim] holds cos in its first half
// and sin in its second, built on the host in float64 (vkrt.ops.rope_cos_sin). Positions
// come from a buffer, never push constants: replayed decode steps rewrite that buffer.
#include "access.glsl"
DECLARE_LOCAL_SIZE;

IN_F32(0, x);
IN_I32(1, positions);
IN_F32(2, cos_sin);
OUT_F32(3, y);

layout(push_constant) uniform Push {
    uint n;            // T * width
    uint width;        // heads * head_dim
    uint head_dim;
    uint rot_dim;
    uint max_positions;
    uint interleaved;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.n) return;
    uint d = i % pc.head_dim;
    if (d >= pc.rot_dim) {
        y[i] = LD_F32(x, i);
        return;
    }
    uint half_rot = pc.rot_dim / 2u;
    // Clamped so a bad position reads a wrong angle instead of out of bounds.
    uint p = uint(clamp(LD_I32(positions, i / pc.width), 0, int(pc.max_positions) - 1));
    uint j, partner;
    bool first;
    if (pc.interleaved != 0u) {
        j = d / 2u;
        first = (d & 1u) == 0u;
        partner = first ? i + 1u : i - 1u;
    } else {
        first = d < half_rot;
        j = first ? d : d - half_rot;
        partner = first ? i + half_rot : i - half_rot;
    }
    float c = LD_F32(cos_sin, p * pc.rot_dim + j);
    float s = LD_F32(cos_sin, p * pc.rot_dim + half_rot + j);
    // `precise` forbids fusing into FMAs, so the result rounds like numpy's f32 reference:
    // bit-exact wherever mul and add are correctly rounded (Vulkan requires it).
    precise float out_value = first ? LD_F32(x, i) * c - LD_F32(x, partner) * s
                                    : LD_F32(x, i) * c + LD_F32(x, partner) * s;
    y[i] = out_value;
}
