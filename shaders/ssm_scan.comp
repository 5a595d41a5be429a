#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// Mamba2's selective scan over each sequence's tokens (vkrt/ops/recurrent.py is the spec). One
// invocation per (sequence, head h, row p of h's state [P, N]) holds that row in registers and
// walks the step's tokens: dt = clamp(softplus(dt + dt_bias), dt_min, dt_max), the row decays by
// exp(dt * A) and takes dt * x[p] * B, and y[t, h, p] = row . C + D * x[p]; then it stores the
// row back into the sequence's slot (zeros at position 0). Every N loop is unrolled, so only the
// token loop counts against gallivm's loop budget. Sequences of at least `chunked_from` tokens are
// the chunked kernels' (ssm_scan_prep.comp, ssm_scan_chunk.comp) and are skipped (0: none is).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint N = 128;  // state size, at most 256

IN_F32(0, xbc);          // [T, H * P + 2 * G * N]: x, B, C
IN_F32(1, dt);           // [T, H]
IN_F32(2, a_rate);       // [H]: A = -exp(A_log)
IN_F32(3, skip);         // [H]: D
IN_F32(4, dt_bias);      // [H]
RW_F32(5, state);        // [slots, H, P, N]
IN_I32(6, seq_start);    // [S + 1]
IN_I32(7, positions);    // [T]
IN_I32(8, state_slots);  // [S]
OUT_F32(9, y);           // [T, H * P]
IN_F32(10, state_in);    // the state again, read through the fast read path (texel on CPU devices)

layout(push_constant) uniform Push {
    uint seqs; uint heads; uint head_dim; uint groups; float dt_min; float dt_max; uint chunked_from;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint per_seq = pc.heads * pc.head_dim;
    if (i >= pc.seqs * per_seq) return;
    uint s = i / per_seq, h = (i % per_seq) / pc.head_dim, p = i % pc.head_dim;
    int t0 = LD_I32(seq_start, s), t1 = LD_I32(seq_start, s + 1u);
    if (t1 <= t0 || (pc.chunked_from != 0u && uint(t1 - t0) >= pc.chunked_from)) return;
    uint inner = pc.heads * pc.head_dim;
    uint width = inner + 2u * pc.groups * N;
    uint g = h / (pc.heads / pc.groups);
    uint b_at = inner + g * N, c_at = inner + pc.groups * N + g * N;
    uint base = ((uint(LD_I32(state_slots, s)) * pc.heads + h) * pc.head_dim + p) * N;
    bool carried = LD_I32(positions, t0) > 0;
    float row[256];
    [[unroll]] for (uint n = 0u; n < N; ++n) row[n] = carried ? LD_F32(state_in, base + n) : 0.0;
    float a = LD_F32(a_rate, h), d = LD_F32(skip, h), bias = LD_F32(dt_bias, h);
    for (int t = t0; t < t1; ++t) {
        uint at = uint(t) * width;
        float raw = LD_F32(dt, uint(t) * pc.heads + h) + bias;
        float step = clamp(raw > 20.0 ? raw : log(1.0 + exp(raw)), pc.dt_min, pc.dt_max);  // torch's softplus
        float decay = exp(step * a);
        float x = LD_F32(xbc, at + h * pc.head_dim + p);
        float dx = step * x;
        float out_value = 0.0;
        [[unroll]] for (uint n = 0u; n < N; ++n) {
            row[n] = row[n] * decay + dx * LD_F32(xbc, at + b_at + n);
            out_value += row[n] * LD_F32(xbc, at + c_at + n);
        }
        y[uint(t) * inner + h * pc.head_dim + p] = out_value + d * x;
    }
    [[unroll]] for (uint n = 0u; n < N; ++n) state[base + n] = row[n];
}
