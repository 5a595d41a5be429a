#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: OP=rms,rms_add,rms_gated,layer ACCESS=texel,ssbo
// Row norms of x [rows, dim], one row per workgroup of W lanes (spec constant 0), two-pass:
// first the row statistic (sum of squares, or mean then centred sum of squares), then the
// normalise pass reads the row again. Reductions follow include/reduce.glsl, whose order is
// independent of the row count. 1.0/sqrt, not inversesqrt (ARCHITECTURE.md invariant 8).
//   rms:     y = x / sqrt(mean(x^2) + eps) * w
//   rms_add: y = residual + rms(x) * w (a post-norm's residual step; `precise` keeps the
//            product rounded before the add, so it equals rms then add bit for bit)
//   rms_gated: y = rms(x) * w * silu(z) (the gated delta net's output norm), or with spec
//            constant 1 rms(x * silu(z)) * w (Mamba2's); a row is one group of the caller's
//            rows, and the weight spans W_GROUPS consecutive rows (spec constant 2: 1, a
//            weight of one group broadcast to all; G, one weight row of G groups)
//   layer:   y = (x - mean) / sqrt(var + eps) * w + b
#include "access.glsl"
#include "reduce.glsl"
DECLARE_LOCAL_SIZE;

IN_F32(0, x);
#if defined(OP_RMS_ADD)
IN_F32(1, w);
IN_F32(2, residual);
OUT_F32(3, y);
#elif defined(OP_LAYER)
IN_F32(1, w);
IN_F32(2, b);
OUT_F32(3, y);
#elif defined(OP_RMS_GATED)
IN_F32(1, z);
IN_F32(2, w);
OUT_F32(3, y);
#else
IN_F32(1, w);
OUT_F32(2, y);
#endif

layout(push_constant) uniform Push { uint rows; uint dim; float eps; } pc;
layout(constant_id = 1) const uint GATE_FIRST = 0;
layout(constant_id = 2) const uint W_GROUPS = 1;

void main() {
    uint row = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (row >= pc.rows) return;  // the whole workgroup leaves: no barrier is skipped by half of it
    uint lane = gl_LocalInvocationID.x;
    uint base = row * pc.dim;
    float n = float(pc.dim);
#if defined(OP_LAYER)
    float sum = 0.0;
    for (uint j = lane; j < pc.dim; j += ROW_LANES) sum += LD_F32(x, base + j);
    float mean = workgroup_sum(sum) / n;
    float sq = 0.0;
    for (uint j = lane; j < pc.dim; j += ROW_LANES) {
        float c = LD_F32(x, base + j) - mean;
        sq += c * c;
    }
    float inv = 1.0 / sqrt(workgroup_sum(sq) / n + pc.eps);
    for (uint j = lane; j < pc.dim; j += ROW_LANES)
        y[base + j] = (LD_F32(x, base + j) - mean) * inv * LD_F32(w, j) + LD_F32(b, j);
#else
    float sq = 0.0;
    for (uint j = lane; j < pc.dim; j += ROW_LANES) {
        float v = LD_F32(x, base + j);
#if defined(OP_RMS_GATED)
        if (GATE_FIRST != 0u) {
            float g = LD_F32(z, base + j);
            v *= g / (1.0 + exp(-g));
        }
#endif
        sq += v * v;
    }
    float inv = 1.0 / sqrt(workgroup_sum(sq) / n + pc.eps);
#if defined(OP_RMS_ADD)
    for (uint j = lane; j < pc.dim; j += ROW_LANES) {
        precise float normed = LD_F32(x, base + j) * inv * LD_F32(w, j);
        y[base + j] = LD_F32(residual, base + j) + normed;
    }
#elif defined(OP_RMS_GATED)
    uint w_base = (row % W_GROUPS) * pc.dim;
    for (uint j = lane; j < pc.dim; j += ROW_LANES) {
        float g = LD_F32(z, base + j);
        float silu = g / (1.0 + exp(-g));
        if (GATE_FIRST != 0u) y[base + j] = LD_F32(x, base + j) * silu * inv * LD_F32(w, w_base + j);
        else y[base + j] = LD_F32(x, base + j) * inv * LD_F32(w, w_base + j) * silu;
    }
#else
    for (uint j = lane; j < pc.dim; j += ROW_LANES) y[base + j] = LD_F32(x, base + j) * inv * LD_F32(w, j);
#endif
#endif
}
