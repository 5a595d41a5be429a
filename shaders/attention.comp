#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// Causal GQA over one contiguous sequence (prefill without a cache): token t attends to rows
// 0..t of k and v. One invocation per (token, head), i = t * num_heads + h; the same online
// softmax as paged_attention (include/attention.glsl).
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 1) const uint HD4 = 16;  // head_dim / 4

IN_F32X4(0, q);
IN_F32X4(1, k);
IN_F32X4(2, v);
OUT_F32X4(3, o);

// group = num_heads / num_kv_heads; kv_dim4 = num_kv_heads * head_dim / 4 (texels per row).
layout(push_constant) uniform Push { uint tokens; uint num_heads; uint group; uint kv_dim4; float scale; } pc;

const float SOFTCAP = 0.0;
const uint ATTENTION_ROWS = 1u;
#define KEY(kv_row, d) LD_F32X4(k, (kv_row) + (d))
#define VALUE(kv_row, d) LD_F32X4(v, (kv_row) + (d))
#include "softcap.glsl"
#include "attention.glsl"

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.tokens * pc.num_heads) return;
    uint t = i / pc.num_heads, h = i % pc.num_heads;
    uint out_row = i * HD4;
    attend_begin(0u, out_row, attention_prescale(pc.scale));
    uint row = (h / pc.group) * HD4;
    for (uint p = 0u; p <= t; ++p, row += pc.kv_dim4) attend_position(0u, row);
    attend_store(0u, out_row, false);
}
