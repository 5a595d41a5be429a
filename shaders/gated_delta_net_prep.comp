#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// The chunked gated delta rule's second pass (vkrt/ops/recurrent.py, gated_delta_net_chunked is
// the spec): one invocation per (token t, value head h) of a sequence the chunked form takes.
// Chunks of CHUNK tokens start at the sequence's first token of the step; t is row i of its
// chunk. Walking the chunk's tokens u = i, i - 1, ..., 0 it accumulates G_t - G_u (the log decay
// between them, so exp never exceeds 1) and writes row i of
//   A[t, h, u]  = beta_t exp(G_t - G_u) k_t . k_u   (u < i: the strictly lower I + A solved later)
//   QK[t, h, u] = exp(G_t - G_u) q_t . k_u          (u <= i: the intra-chunk attention)
// and G_t itself (the chunk's cumulative log decay up to t) and beta_t. Entries past i are
// never written nor read. Only the walk over u counts against gallivm's loop budget.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint DK = 128;    // key head dim, at most 256
layout(constant_id = 2) const uint CHUNK = 64;  // tokens per chunk, at most 64

IN_F32(0, qk);         // [T, 2 * Hk, DK]: normalised q heads, then k heads
IN_F32(1, ba);         // [T, 2 * Hv]: b, then a
IN_F32(2, a_rate);     // [Hv]: A = -exp(A_log)
IN_F32(3, dt_bias);    // [Hv]
IN_I32(4, seq_start);  // [S + 1]
OUT_F32(5, amat);      // [T, Hv, CHUNK]
OUT_F32(6, qkmat);     // [T, Hv, CHUNK]
OUT_F32(7, gcum);      // [T, Hv]
OUT_F32(8, beta);      // [T, Hv]

layout(push_constant) uniform Push {
    uint tokens; uint seqs; uint k_heads; uint v_heads; uint tiled; float beta_scale; uint chunked_from;
} pc;

float log_decay(uint u, uint h, float a_scale, float a_bias) {  // g = A * softplus(a + dt_bias)
    float a = LD_F32(ba, u * 2u * pc.v_heads + pc.v_heads + h) + a_bias;
    return a_scale * (a > 20.0 ? a : log(1.0 + exp(a)));  // torch's softplus
}

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.v_heads) return;
    uint t = i / pc.v_heads, h = i % pc.v_heads;
    uint lo = 0u, hi = pc.seqs - 1u;  // the last sequence starting at or before t (never an empty one)
    while (lo < hi) {
        uint mid = (lo + hi + 1u) / 2u;
        if (uint(LD_I32(seq_start, mid)) <= t) lo = mid; else hi = mid - 1u;
    }
    uint t0 = uint(LD_I32(seq_start, lo)), t1 = uint(LD_I32(seq_start, lo + 1u));
    if (t1 - t0 < pc.chunked_from) return;  // the recurrent kernel's sequence
    uint c0 = t0 + (t - t0) / CHUNK * CHUNK;
    uint hk = pc.tiled != 0u ? h % pc.k_heads : h / (pc.v_heads / pc.k_heads);
    uint q_row = (t * 2u * pc.k_heads + hk) * DK, k_of = (pc.k_heads + hk) * DK;
    float q[256], k[256];
    [[unroll]] for (uint d = 0u; d < DK; ++d) {
        q[d] = LD_F32(qk, q_row + d);
        k[d] = LD_F32(qk, t * 2u * pc.k_heads * DK + k_of + d);
    }
    float a_scale = LD_F32(a_rate, h), a_bias = LD_F32(dt_bias, h);
    float b = pc.beta_scale / (1.0 + exp(-LD_F32(ba, t * 2u * pc.v_heads + h)));
    uint row = i * CHUNK;
    float acc = 0.0;  // G_t - G_u
    for (uint u = t + 1u; u-- > c0;) {
        uint ku = u * 2u * pc.k_heads * DK + k_of;
        float kk = 0.0, qq = 0.0;
        [[unroll]] for (uint d = 0u; d < DK; ++d) {
            float x = LD_F32(qk, ku + d);
            kk += k[d] * x;
            qq += q[d] * x;
        }
        float decay = exp(acc);
        if (u < t) amat[row + u - c0] = b * decay * kk;
        qkmat[row + u - c0] = decay * qq;
        acc += log_decay(u, h, a_scale, a_bias);
    }
    gcum[i] = acc;
    beta[i] = b;
}
