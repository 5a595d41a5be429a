#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: ACCESS=texel,ssbo
// The second pass of paged_attention split over the context: per (token, head) fold the
// chunks' partial softmax states (paged_attention.comp with CHUNK > 0: a vec4 (max, sum, 0,
// 0), then hd4 vec4s of weighted values) in chunk order, and normalise. One invocation per
// (token, head, vec4 of the head). A chunk holding the maximum weighs exactly 1, so a token
// whose positions fall in one chunk gets the unsplit kernel's bits; neutral chunks (max
// -inf) add exact zeros. seq_index < 0 marks a padding row (output zeros).
#include "access.glsl"
DECLARE_LOCAL_SIZE;

IN_F32X4(0, partials);
IN_I32(1, seq_index);
OUT_F32X4(2, o);

// tokens handled (from token0 of the batch), heads, head_dim / 4, chunks per (token, head).
layout(push_constant) uniform Push { uint tokens; uint num_heads; uint hd4; uint chunks; uint token0; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.num_heads * pc.hd4) return;
    uint local_row = i / pc.hd4, d = i % pc.hd4;
    uint row = pc.token0 * pc.num_heads + local_row;
    uint out_index = row * pc.hd4 + d;
    if (LD_I32(seq_index, row / pc.num_heads) < 0) {
        o[out_index] = vec4(0.0);
        return;
    }
    uint stride = pc.hd4 + 1u;
    uint base = local_row * pc.chunks * stride;
    float m = uintBitsToFloat(0xFF800000u);
    for (uint c = 0u; c < pc.chunks; ++c) m = max(m, LD_F32X4(partials, base + c * stride).x);
    float sum = 0.0;
    vec4 total = vec4(0.0);
    for (uint c = 0u; c < pc.chunks; ++c) {
        vec2 state = LD_F32X4(partials, base + c * stride).xy;
        float w = state.x == m ? 1.0 : exp2(state.x - m);  // exp2(-inf) = 0 for neutral chunks
        sum += state.y * w;
        total += LD_F32X4(partials, base + c * stride + 1u + d) * w;
    }
    o[out_index] = total * (1.0 / sum);
}
