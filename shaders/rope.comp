#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: ACCESS=texel,ssbo
// Rotary embedding of x [T, heads * head_dim], one invocation per output element; the
// rotation, its pairs and the cos_sin table are include/rope.glsl's.
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

#define ROPE_LOAD(i, d) LD_F32(x, i)
#include "rope.glsl"

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.n) return;
    uint p = rope_position(i / pc.width, pc.max_positions);
    y[i] = rope_element(i, i % pc.head_dim, p, pc.rot_dim, pc.interleaved != 0u);
}
