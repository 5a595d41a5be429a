#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// The chunked gated delta rule's last pass (vkrt/ops/recurrent.py, gated_delta_net_chunked is the
// spec): one invocation per (sequence, value head h, state column j), as the recurrent kernel,
// holds column j of S [DK, dv] in registers and walks the sequence's chunks; within a chunk S is
// the state S0 before it, so each token needs only dot products with S0, the solve and the
// intra-chunk sums over the rows the prep pass wrote:
//   r_i = beta_i (v_i[j] - exp(G_i) k_i . S0);  vn_i = r_i - sum_{u<i} A[i, u] vn_u  (forwards);
//   o_i[j] = exp(G_i) q_i . S0 + sum_{u<=i} QK[i, u] vn_u;
// then S = exp(G_last) S0 + sum_u exp(G_last - G_u) k_u vn_u. The u loops run CHUNK unrolled
// iterations behind a test, so a token costs two back-edges of gallivm's 65535 loop iterations
// per invocation (the recurrent walk costs one).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint DK = 128;    // key head dim, at most 256
layout(constant_id = 2) const uint CHUNK = 64;  // tokens per chunk, at most 64

IN_F32(0, qkv);          // [T, 2 * Hk * DK + Hv * dv]: v is read from here
IN_F32(1, qk);           // [T, 2 * Hk, DK]: normalised q heads, then k heads
IN_F32(2, amat);         // [T, Hv, CHUNK]
IN_F32(3, qkmat);        // [T, Hv, CHUNK]
IN_F32(4, gcum);         // [T, Hv]
IN_F32(5, beta);         // [T, Hv]
RW_F32(6, state);        // [slots, Hv, DK, dv]
IN_I32(7, seq_start);    // [S + 1]
IN_I32(8, positions);    // [T]
IN_I32(9, state_slots);  // [S]
OUT_F32(10, o);          // [T, Hv * dv]
IN_F32(11, state_in);    // the state again, read through the fast read path (texel on CPU devices)

layout(push_constant) uniform Push { uint seqs; uint k_heads; uint v_heads; uint dv; uint tiled; uint chunked_from; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint per_seq = pc.v_heads * pc.dv;
    if (i >= pc.seqs * per_seq) return;
    uint s = i / per_seq, h = (i % per_seq) / pc.dv, j = i % pc.dv;
    int t0 = LD_I32(seq_start, s), t1 = LD_I32(seq_start, s + 1u);
    if (t1 <= t0 || uint(t1 - t0) < pc.chunked_from) return;  // empty, or the recurrent kernel's
    uint hk = pc.tiled != 0u ? h % pc.k_heads : h / (pc.v_heads / pc.k_heads);
    uint width = 2u * pc.k_heads * DK + pc.v_heads * pc.dv;
    uint q_of = hk * DK, k_of = (pc.k_heads + hk) * DK, v_at = 2u * pc.k_heads * DK + h * pc.dv + j;
    uint base = (uint(LD_I32(state_slots, s)) * pc.v_heads + h) * DK * pc.dv + j;
    bool carried = LD_I32(positions, t0) > 0;
    float S[256];
    [[unroll]] for (uint d = 0u; d < DK; ++d) S[d] = carried ? LD_F32(state_in, base + d * pc.dv) : 0.0;
    float vn[64];
    for (uint c0 = uint(t0); c0 < uint(t1); c0 += CHUNK) {
        uint n = min(CHUNK, uint(t1) - c0);
        for (uint r = 0u; r < n; ++r) {
            uint t = c0 + r, th = t * pc.v_heads + h, qk_row = t * 2u * pc.k_heads * DK;
            float ks = 0.0, qs = 0.0;
            [[unroll]] for (uint d = 0u; d < DK; ++d) {
                ks += LD_F32(qk, qk_row + k_of + d) * S[d];
                qs += LD_F32(qk, qk_row + q_of + d) * S[d];
            }
            float decay = exp(LD_F32(gcum, th));
            float x = LD_F32(beta, th) * (LD_F32(qkv, t * width + v_at) - decay * ks);
            [[unroll]] for (uint u = 0u; u < CHUNK; ++u) {
                if (u < r) x -= LD_F32(amat, th * CHUNK + u) * vn[u];
            }
            vn[r] = x;
            float out_value = decay * qs;
            [[unroll]] for (uint u = 0u; u < CHUNK; ++u) {
                if (u <= r) out_value += LD_F32(qkmat, th * CHUNK + u) * vn[u];
            }
            o[t * pc.v_heads * pc.dv + h * pc.dv + j] = out_value;
        }
        float g_last = LD_F32(gcum, (c0 + n - 1u) * pc.v_heads + h);
        float carry = exp(g_last);
        [[unroll]] for (uint d = 0u; d < DK; ++d) S[d] *= carry;
        for (uint r = 0u; r < n; ++r) {
            uint t = c0 + r, k_row = t * 2u * pc.k_heads * DK + k_of;
            float w = exp(g_last - LD_F32(gcum, t * pc.v_heads + h)) * vn[r];
            [[unroll]] for (uint d = 0u; d < DK; ++d) S[d] += LD_F32(qk, k_row + d) * w;
        }
    }
    [[unroll]] for (uint d = 0u; d < DK; ++d) state[base + d * pc.dv] = S[d];
}
