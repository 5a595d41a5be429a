#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// Mamba2's chunked scan (SSD), first pass (vkrt/ops/recurrent.py, ssm_scan_chunked is the spec):
// one invocation per (token t, head h) of a sequence the chunked form takes. Chunks of CHUNK
// tokens start at the sequence's first token of the step; t is row i of its chunk. Walking the
// chunk's tokens u = i, i - 1, ..., 0 it accumulates L_t - L_u (the log decay dt * A between
// them, so exp never exceeds 1) and writes row i of
//   W[t, h, u] = exp(L_t - L_u) C_t . B_u   (u <= i: how dt_u x_u reaches y_t inside the chunk)
// and L_t itself (the chunk's cumulative log decay up to t) and dt_t, with dt = clamp(softplus(
// dt + dt_bias), dt_min, dt_max) as the recurrent scan takes it. Entries past i are never written
// nor read. Heads of one group share B and C, so their C . B products repeat: this pass is a
// small part of the work (CHUNK x N per token and head, against the chunk pass's 2 x N x P).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint N = 128;     // state size, at most 256
layout(constant_id = 2) const uint CHUNK = 64;  // tokens per chunk, at most 64

IN_F32(0, xbc);        // [T, H * P + 2 * G * N]: x, B, C
IN_F32(1, dt);         // [T, H]
IN_F32(2, a_rate);     // [H]: A = -exp(A_log)
IN_F32(3, dt_bias);    // [H]
IN_I32(4, seq_start);  // [S + 1]
OUT_F32(5, weights);   // [T, H, CHUNK]
OUT_F32(6, lcum);      // [T, H]
OUT_F32(7, steps);     // [T, H]

layout(push_constant) uniform Push {
    uint tokens; uint seqs; uint heads; uint head_dim; uint groups; float dt_min; float dt_max; uint chunked_from;
} pc;

float time_step(uint u, uint h, float bias) {
    float raw = LD_F32(dt, u * pc.heads + h) + bias;
    return clamp(raw > 20.0 ? raw : log(1.0 + exp(raw)), pc.dt_min, pc.dt_max);  // torch's softplus
}

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.heads) return;
    uint t = i / pc.heads, h = i % pc.heads;
    uint lo = 0u, hi = pc.seqs - 1u;  // the last sequence starting at or before t (never an empty one)
    while (lo < hi) {
        uint mid = (lo + hi + 1u) / 2u;
        if (uint(LD_I32(seq_start, mid)) <= t) lo = mid; else hi = mid - 1u;
    }
    uint t0 = uint(LD_I32(seq_start, lo)), t1 = uint(LD_I32(seq_start, lo + 1u));
    if (t1 - t0 < pc.chunked_from) return;  // the recurrent kernel's sequence
    uint c0 = t0 + (t - t0) / CHUNK * CHUNK;
    uint width = pc.heads * pc.head_dim + 2u * pc.groups * N;
    uint g = h / (pc.heads / pc.groups);
    uint b_of = pc.heads * pc.head_dim + g * N, c_of = b_of + pc.groups * N;
    float c[256];
    [[unroll]] for (uint n = 0u; n < N; ++n) c[n] = LD_F32(xbc, t * width + c_of + n);
    float a = LD_F32(a_rate, h), bias = LD_F32(dt_bias, h);
    uint row = i * CHUNK;
    float acc = 0.0;  // L_t - L_u
    for (uint u = t + 1u; u-- > c0;) {
        float cb = 0.0;
        [[unroll]] for (uint n = 0u; n < N; ++n) cb += c[n] * LD_F32(xbc, u * width + b_of + n);
        float step = time_step(u, h, bias);
        weights[row + u - c0] = exp(acc) * cb;
        if (u == t) steps[i] = step;
        acc += step * a;
    }
    lcum[i] = acc;
}
