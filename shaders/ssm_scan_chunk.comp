#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// Mamba2's chunked scan (SSD), last pass (vkrt/ops/recurrent.py, ssm_scan_chunked is the spec):
// one invocation per (sequence, head h, row p of h's state [P, N]), as the recurrent scan, holds
// that row in registers and walks the sequence's chunks; within a chunk the row is h0, the state
// before it, so each token needs one dot product with h0 and the intra-chunk sum over the
// weights the prep pass wrote, and no token waits on the one before it:
//   dx_i = dt_i x_i[p];  y_i[p] = exp(L_i) h0 . C_i + sum_{u<=i} W[i, u] dx_u + D x_i[p];
// then h = exp(L_last) h0 + sum_u exp(L_last - L_u) dx_u B_u. The u loop runs CHUNK unrolled
// iterations behind a test, so a token costs two back-edges of gallivm's 65535 loop iterations
// per invocation (the recurrent scan costs one).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint N = 128;     // state size, at most 256
layout(constant_id = 2) const uint CHUNK = 64;  // tokens per chunk, at most 64

IN_F32(0, xbc);          // [T, H * P + 2 * G * N]: x, B, C
IN_F32(1, skip);         // [H]: D
IN_F32(2, weights);      // [T, H, CHUNK]
IN_F32(3, lcum);         // [T, H]
IN_F32(4, steps);        // [T, H]
RW_F32(5, state);        // [slots, H, P, N]
IN_I32(6, seq_start);    // [S + 1]
IN_I32(7, positions);    // [T]
IN_I32(8, state_slots);  // [S]
OUT_F32(9, y);           // [T, H * P]
IN_F32(10, state_in);    // the state again, read through the fast read path (texel on CPU devices)

layout(push_constant) uniform Push { uint seqs; uint heads; uint head_dim; uint groups; uint chunked_from; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint inner = pc.heads * pc.head_dim;
    if (i >= pc.seqs * inner) return;
    uint s = i / inner, h = (i % inner) / pc.head_dim, p = i % pc.head_dim;
    int t0 = LD_I32(seq_start, s), t1 = LD_I32(seq_start, s + 1u);
    if (t1 <= t0 || uint(t1 - t0) < pc.chunked_from) return;  // empty, or the recurrent kernel's
    uint width = inner + 2u * pc.groups * N;
    uint g = h / (pc.heads / pc.groups);
    uint b_of = inner + g * N, c_of = b_of + pc.groups * N, x_of = h * pc.head_dim + p;
    uint base = ((uint(LD_I32(state_slots, s)) * pc.heads + h) * pc.head_dim + p) * N;
    bool carried = LD_I32(positions, t0) > 0;
    float row[256];
    [[unroll]] for (uint n = 0u; n < N; ++n) row[n] = carried ? LD_F32(state_in, base + n) : 0.0;
    float d = LD_F32(skip, h);
    float dx[64];
    for (uint c0 = uint(t0); c0 < uint(t1); c0 += CHUNK) {
        uint len = min(CHUNK, uint(t1) - c0);
        for (uint r = 0u; r < len; ++r) {
            uint t = c0 + r, th = t * pc.heads + h;
            float x = LD_F32(xbc, t * width + x_of);
            dx[r] = LD_F32(steps, th) * x;
            float hc = 0.0;
            [[unroll]] for (uint n = 0u; n < N; ++n) hc += row[n] * LD_F32(xbc, t * width + c_of + n);
            float out_value = exp(LD_F32(lcum, th)) * hc;
            [[unroll]] for (uint u = 0u; u < CHUNK; ++u) {
                if (u <= r) out_value += LD_F32(weights, th * CHUNK + u) * dx[u];
            }
            y[t * inner + x_of] = out_value + d * x;
        }
        float l_last = LD_F32(lcum, (c0 + len - 1u) * pc.heads + h);
        float carry = exp(l_last);
        [[unroll]] for (uint n = 0u; n < N; ++n) row[n] *= carry;
        for (uint r = 0u; r < len; ++r) {
            uint t = c0 + r;
            float w = exp(l_last - LD_F32(lcum, t * pc.heads + h)) * dx[r];
            [[unroll]] for (uint n = 0u; n < N; ++n) row[n] += w * LD_F32(xbc, t * width + b_of + n);
        }
    }
    [[unroll]] for (uint n = 0u; n < N; ++n) state[base + n] = row[n];
}
