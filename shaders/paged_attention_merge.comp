#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: ACCESS=texel,ssbo
// The second pass of paged_attention split over the context: per (token, head) fold the
// partial softmax states of the chunks its window touches (a vec4 (max, sum, 0, 0), then hd4
// vec4s of weighted values, written by paged_attention.comp or paged_attention_gqa.comp with
// pc.chunks > 1) in chunk order with include/chunk_merge.glsl's weights, and normalise: the
// same operations a kernel walking all of a row's chunks itself performs, so both give the
// same bits. One invocation per (token, head, vec4 of the head). Chunks the window misses
// were never written and are not read. seq_index < 0 marks a padding row (output zeros).
#include "access.glsl"
#include "chunk_merge.glsl"
DECLARE_LOCAL_SIZE;

IN_F32X4(0, partials);
IN_I32(1, seq_index);
IN_I32(2, positions);
OUT_F32X4(3, o);
IN_F32(4, sinks);
// Attention sinks (gpt-oss): sinks[h] joins the row's denominator after its last chunk, as a
// kernel walking the row's chunks itself adds it. Off, the binding is unread.
layout(constant_id = 1) const bool SINKS = false;

// tokens handled (from token0 of the batch), heads, head_dim / 4, chunks per (token, head),
// positions per chunk, the table's width in positions, the sliding window (0: none).
layout(push_constant) uniform Push {
    uint tokens; uint num_heads; uint hd4; uint chunks; uint token0;
    uint chunk; uint table_positions; uint window;
} pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.num_heads * pc.hd4) return;
    uint local_row = i / pc.hd4, d = i % pc.hd4;
    uint row = pc.token0 * pc.num_heads + local_row;
    uint t = row / pc.num_heads;
    uint out_index = row * pc.hd4 + d;
    if (LD_I32(seq_index, t) < 0) {
        o[out_index] = vec4(0.0);
        return;
    }
    uint n = row_end(LD_I32(positions, t), pc.table_positions);
    uvec2 span = row_chunks(row_first(n, pc.window), n, pc.chunk);
    uint stride = pc.hd4 + 1u;
    uint base = local_row * pc.chunks * stride;
    uint c0 = span.x;
    vec2 state = LD_F32X4(partials, base + c0 * stride).xy;  // the first chunk, as it is
    float m = state.x;
    float sum = state.y;
    vec4 total = LD_F32X4(partials, base + c0 * stride + 1u + d);
    for (uint c = c0 + 1u; c <= span.y; ++c) {
        state = LD_F32X4(partials, base + c * stride).xy;
        vec2 w = merge_weights(m, state.x);
        precise float s = sum * w.x + state.y * w.y;
        sum = s;
        m = max(m, state.x);
        precise vec4 a = total * w.x + LD_F32X4(partials, base + c * stride + 1u + d) * w.y;
        total = a;
    }
    if (SINKS) {
        vec2 w = sink_merge(m, sum, LD_F32(sinks, row % pc.num_heads));
        sum = w.y;
        precise vec4 a = total * w.x;
        total = a;
    }
    precise float inv_sum = 1.0 / sum;
    precise vec4 normalised = total * inv_sum;
    o[out_index] = normalised;
}
