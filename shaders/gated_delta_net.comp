#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// The gated delta rule over each sequence's tokens (vkrt/ops/recurrent.py is the spec). One
// invocation per (sequence, value head h, state column j) holds column j of h's state S [dk, dv]
// in registers and walks the step's tokens in order: it L2-normalises its key head's q and k,
// decays S by exp(g), moves it towards v by beta (the delta rule), and writes o[t, h, j] = S^T q;
// then stores the column back into the sequence's slot. A sequence at position 0 starts from
// S = 0. Neighbouring invocations own neighbouring columns (state rows are dv wide), so their
// state loads are consecutive. Every dk loop is unrolled, so only the token loop counts against
// gallivm's 65535 loop iterations per invocation (docs/ARCHITECTURE.md).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint DK = 128;  // key head dim, at most 256

IN_F32(0, qkv);          // [T, 2 * Hk * DK + Hv * dv]: q, k, v
IN_F32(1, ba);           // [T, 2 * Hv]: b, then a
IN_F32(2, a_rate);       // [Hv]: A = -exp(A_log)
IN_F32(3, dt_bias);      // [Hv]
RW_F32(4, state);        // [slots, Hv, DK, dv]
IN_I32(5, seq_start);    // [S + 1]
IN_I32(6, positions);    // [T]
IN_I32(7, state_slots);  // [S]
OUT_F32(8, o);           // [T, Hv * dv]
IN_F32(9, state_in);     // the state again, read through the fast read path (texel on CPU devices)

// chunked_from: sequences of at least this many tokens are the chunked kernels' (0: none is)
layout(push_constant) uniform Push {
    uint seqs; uint k_heads; uint v_heads; uint dv; uint tiled; float beta_scale; uint chunked_from;
} pc;

const float L2_EPS = 1e-6;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint per_seq = pc.v_heads * pc.dv;
    if (i >= pc.seqs * per_seq) return;
    uint s = i / per_seq, h = (i % per_seq) / pc.dv, j = i % pc.dv;
    int t0 = LD_I32(seq_start, s), t1 = LD_I32(seq_start, s + 1u);
    if (t1 <= t0 || (pc.chunked_from != 0u && uint(t1 - t0) >= pc.chunked_from)) return;
    // the key head: value heads grouped by key head (HF), or tiled over them (llama.cpp's GGUF)
    uint hk = pc.tiled != 0u ? h % pc.k_heads : h / (pc.v_heads / pc.k_heads);
    uint width = 2u * pc.k_heads * DK + pc.v_heads * pc.dv;
    uint q_at = hk * DK, k_at = pc.k_heads * DK + hk * DK, v_at = 2u * pc.k_heads * DK + h * pc.dv + j;
    uint base = (uint(LD_I32(state_slots, s)) * pc.v_heads + h) * DK * pc.dv + j;
    bool carried = LD_I32(positions, t0) > 0;
    float S[256];
    [[unroll]] for (uint d = 0u; d < DK; ++d) S[d] = carried ? LD_F32(state_in, base + d * pc.dv) : 0.0;
    float a_scale = LD_F32(a_rate, h), a_bias = LD_F32(dt_bias, h);
    float k_scale = 1.0 / sqrt(float(DK));
    for (int t = t0; t < t1; ++t) {
        uint row = uint(t) * width;
        float kn[256];
        float qq = 0.0, kk = 0.0;
        [[unroll]] for (uint d = 0u; d < DK; ++d) {
            float q = LD_F32(qkv, row + q_at + d);
            kn[d] = LD_F32(qkv, row + k_at + d);
            qq += q * q;
            kk += kn[d] * kn[d];
        }
        float k_norm = 1.0 / sqrt(kk + L2_EPS), q_norm = 1.0 / sqrt(qq + L2_EPS) * k_scale;
        float b = LD_F32(ba, uint(t) * 2u * pc.v_heads + h);
        float a = LD_F32(ba, uint(t) * 2u * pc.v_heads + pc.v_heads + h) + a_bias;
        float beta = pc.beta_scale / (1.0 + exp(-b));  // beta_scale 2: OLMo-hybrid's negative eigenvalues
        float decay = exp(a_scale * (a > 20.0 ? a : log(1.0 + exp(a))));  // torch's softplus
        float kv = 0.0;
        [[unroll]] for (uint d = 0u; d < DK; ++d) {
            kn[d] *= k_norm;
            S[d] *= decay;
            kv += S[d] * kn[d];
        }
        float delta = (LD_F32(qkv, row + v_at) - kv) * beta;
        float out_value = 0.0;
        [[unroll]] for (uint d = 0u; d < DK; ++d) {
            S[d] += kn[d] * delta;
            out_value += S[d] * (LD_F32(qkv, row + q_at + d) * q_norm);
        }
        o[uint(t) * pc.v_heads * pc.dv + h * pc.dv + j] = out_value;
    }
    [[unroll]] for (uint d = 0u; d < DK; ++d) state[base + d * pc.dv] = S[d];
}
