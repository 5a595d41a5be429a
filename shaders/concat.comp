#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: ACCESS=texel,ssbo
// concat_columns: y [T, A + B + C] = [a | b | c] for a [T, A], b [T, B], c [T, C]; two
// parts bind b again as c with C = 0 (never read). One invocation per output element.
#include "access.glsl"
DECLARE_LOCAL_SIZE;

IN_F32(0, a);
IN_F32(1, b);
IN_F32(2, c);
OUT_F32(3, y);

layout(push_constant) uniform Push { uint n; uint width_a; uint width_b; uint width_c; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.n) return;
    uint width = pc.width_a + pc.width_b + pc.width_c;
    uint row = i / width, col = i % width;
    if (col < pc.width_a) y[i] = LD_F32(a, row * pc.width_a + col);
    else if (col < pc.width_a + pc.width_b) y[i] = LD_F32(b, row * pc.width_b + col - pc.width_a);
    else y[i] = LD_F32(c, row * pc.width_c + col - pc.width_a - pc.width_b);
}
