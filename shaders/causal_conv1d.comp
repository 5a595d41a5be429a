#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: FORM=plain,gated ACCESS=texel,ssbo
// Depthwise causal convolution over each sequence's positions with its carried state
// (vkrt/ops/recurrent.py is the spec). One invocation per (sequence, channel) walks the
// sequence's tokens of the step in order, holding the last K - 1 inputs of its channel in
// registers: it reads them from the state slot (or zeros when the sequence starts at position
// 0), writes one output per token, then writes the window back into the slot. Only this
// invocation reads or writes that (slot, channel), so the in-place update needs no barrier,
// and each output is the same sum in the same order whatever else is in the batch.
//   FORM_PLAIN: in = x[t, c]; y = act(sum_j w[c, j] * in_j + bias[c]) (spec constant 2: silu).
//   FORM_GATED: x is [B | C | x] per token (LFM2): in = B * x; y = C * (sum + bias).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint TAPS = 4;  // K, at most MAX_CONV_KERNEL (8)
layout(constant_id = 2) const uint SILU = 0;

IN_F32(0, x);
IN_F32(1, w);          // [C, K]
IN_F32(2, bias);       // [C]
RW_F32(3, state);      // [slots, C, K - 1]
IN_I32(4, seq_start);  // [S + 1]
IN_I32(5, positions);  // [T]
IN_I32(6, state_slots);  // [S]
OUT_F32(7, y);         // [T, C]

layout(push_constant) uniform Push { uint seqs; uint channels; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.seqs * pc.channels) return;
    uint s = i / pc.channels, c = i % pc.channels;
    int t0 = LD_I32(seq_start, s), t1 = LD_I32(seq_start, s + 1u);
    if (t1 <= t0) return;
    uint slot = uint(LD_I32(state_slots, s));
    uint base = (slot * pc.channels + c) * (TAPS - 1u);
    bool carried = LD_I32(positions, t0) > 0;
    float window[8];  // window[j]: the input j taps before the newest
    [[unroll]] for (uint j = 0u; j + 1u < TAPS; ++j) window[j] = carried ? state[base + j] : 0.0;
    float taps[8];
    [[unroll]] for (uint j = 0u; j < TAPS; ++j) taps[j] = LD_F32(w, c * TAPS + j);
    float b = LD_F32(bias, c);
#if defined(FORM_GATED)
    uint row = 3u * pc.channels;
#else
    uint row = pc.channels;
#endif
    for (int t = t0; t < t1; ++t) {
#if defined(FORM_GATED)
        precise float fresh = LD_F32(x, uint(t) * row + c) * LD_F32(x, uint(t) * row + 2u * pc.channels + c);
#else
        float fresh = LD_F32(x, uint(t) * row + c);
#endif
        // taps[0] meets the oldest input, taps[K - 1] the newest (the state's layout).
        precise float acc = 0.0;
        [[unroll]] for (uint j = 0u; j + 1u < TAPS; ++j) acc = acc + taps[j] * window[j];
        acc = acc + taps[TAPS - 1u] * fresh;
        precise float out_value = acc + b;
#if defined(FORM_GATED)
        out_value = LD_F32(x, uint(t) * row + pc.channels + c) * out_value;
#else
        if (SILU != 0u) out_value = out_value / (1.0 + exp(-out_value));
#endif
        y[uint(t) * pc.channels + c] = out_value;
        [[unroll]] for (uint j = 0u; j + 2u < TAPS; ++j) window[j] = window[j + 1u];
        if (TAPS > 1u) window[TAPS - 2u] = fresh;
    }
    [[unroll]] for (uint j = 0u; j + 1u < TAPS; ++j) state[base + j] = window[j];
}
