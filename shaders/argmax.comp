#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: ACCESS=texel,ssbo
// argmax over the last axis of x [rows, n] -> i32 [rows], exactly numpy's: the first index
// of the maximum, a NaN counting as the maximum. One row per workgroup of ROW_LANES lanes;
// each lane scans columns lane, lane + W, ... keeping its first best, then
// workgroup_argmax breaks ties between lanes by the smaller index.
#include "access.glsl"
#include "reduce.glsl"
DECLARE_LOCAL_SIZE;

IN_F32(0, x);
OUT_I32(1, y);

layout(push_constant) uniform Push { uint rows; uint n; } pc;

void main() {
    uint row = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (row >= pc.rows) return;  // the whole workgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint base = row * pc.n;
    // A lane with no columns (n < W) holds (-inf, max uint), which loses every comparison.
    float best = -1.0 / 0.0;
    uint best_i = 0xFFFFFFFFu;
    for (uint j = lane; j < pc.n; j += ROW_LANES) {
        float v = LD_F32(x, base + j);
        // Indices only grow within a lane, so a tie keeps the earlier one.
        if (best_i == 0xFFFFFFFFu || v > best || (isnan(v) && !isnan(best))) {
            best = v;
            best_i = j;
        }
    }
    uint winner = workgroup_argmax(best, best_i);
    if (lane == 0u) y[row] = int(winner);
}
