#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: ACCESS=texel,ssbo
// softmax over the last axis of x [rows, n], one row per workgroup of ROW_LANES lanes:
// the row max first, then exp(x - max) written to y and summed, then y divided by the sum.
// Reductions follow include/reduce.glsl (order independent of the row count).
#include "access.glsl"
#include "reduce.glsl"
DECLARE_LOCAL_SIZE;

IN_F32(0, x);
RW_F32(1, y);

layout(push_constant) uniform Push { uint rows; uint n; } pc;

void main() {
    uint row = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (row >= pc.rows) return;  // the whole workgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint base = row * pc.n;
    float m = -1.0 / 0.0;
    for (uint j = lane; j < pc.n; j += ROW_LANES) m = max(m, LD_F32(x, base + j));
    m = workgroup_max(m);
    // Kahan-compensated: a plain f32 sum of 49152 exps across 8 lanes measured 1e-5 low;
    // `precise` keeps the compiler from simplifying the compensation away.
    precise float sum = 0.0, carry = 0.0;
    for (uint j = lane; j < pc.n; j += ROW_LANES) {
        float e = exp(LD_F32(x, base + j) - m);
        y[base + j] = e;
        precise float term = e - carry;
        precise float next = sum + term;
        carry = (next - sum) - term;
        sum = next;
    }
    sum = workgroup_sum(sum);
    // Each lane rescales only the elements it wrote, so no barrier is needed between passes.
    for (uint j = lane; j < pc.n; j += ROW_LANES) y[base + j] = y[base + j] / sum;
}
