#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: OP=add,sigmoid_mul,silu_mul,gelu_mul,clamped_swiglu,gather,scale,softcap,relu2,gelu_mul_slice ACCESS=texel,ssbo
// add: y[i] = a[i] + b[i % b_len]  (b_len = n for same shape, D for a row broadcast)
// sigmoid_mul: y[i] = a[i] * sigmoid(b[i % b_len]) (an output gate)
// gather: y[r, d] = a[b[r], d] (b holds i32 row indices, b_len = D).
// silu_mul/gelu_mul: x is [T, 2F]; y[t, f] = act(x[t, f]) * x[t, F + f], with b_len = F.
// clamped_swiglu (gpt-oss): the same halves, g = min(gate, param), u = clamp(up, -param, param),
// y = g * sigmoid(alpha * g) * (u + 1).
// scale: y = x * param (one rounded f32 product). softcap: y = param * tanh(x / param).
// relu2: y = max(x, 0)^2 (one rounded f32 product).
// gelu_mul_slice: y [T, b_len] = gelu_mul of a [T, b_len] and columns start .. start + b_len - 1
// of b [T, b_width] (Gemma 4's per-layer gate; the same gelu_tanh_mul as gelu_mul).
#include "access.glsl"
#include "softcap.glsl"
#include "gelu.glsl"
DECLARE_LOCAL_SIZE;

#if defined(OP_ADD) || defined(OP_SIGMOID_MUL) || defined(OP_GELU_MUL_SLICE)
IN_F32(0, a);
IN_F32(1, b);
OUT_F32(2, y);
#elif defined(OP_GATHER)
IN_F32(0, a);
IN_I32(1, b);
OUT_F32(2, y);
#else
IN_F32(0, x);
OUT_F32(1, y);
#endif

#ifdef OP_CLAMPED_SWIGLU
layout(push_constant) uniform Push { uint n; uint b_len; float param; float alpha; } pc;
#elif defined(OP_GELU_MUL_SLICE)
layout(push_constant) uniform Push { uint n; uint b_len; uint start; uint b_width; } pc;
#else
layout(push_constant) uniform Push { uint n; uint b_len; float param; } pc;
#endif

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.n) return;
#if defined(OP_ADD)
    y[i] = LD_F32(a, i) + LD_F32(b, i % pc.b_len);
#elif defined(OP_SIGMOID_MUL)
    y[i] = LD_F32(a, i) * (1.0 / (1.0 + exp(-LD_F32(b, i % pc.b_len))));
#elif defined(OP_GATHER)
    y[i] = LD_F32(a, uint(LD_I32(b, i / pc.b_len)) * pc.b_len + i % pc.b_len);
#elif defined(OP_SCALE)
    y[i] = LD_F32(x, i) * pc.param;
#elif defined(OP_SOFTCAP)
    y[i] = softcap_f32(LD_F32(x, i), pc.param);
#elif defined(OP_RELU2)
    float r = max(LD_F32(x, i), 0.0);
    y[i] = r * r;
#elif defined(OP_GELU_MUL_SLICE)
    y[i] = gelu_tanh_mul(LD_F32(a, i), LD_F32(b, (i / pc.b_len) * pc.b_width + pc.start + i % pc.b_len));
#else
    uint row = i / pc.b_len, col = i % pc.b_len;
    float g = LD_F32(x, row * 2u * pc.b_len + col);
    float u = LD_F32(x, row * 2u * pc.b_len + pc.b_len + col);
#if defined(OP_SILU_MUL)
    y[i] = g / (1.0 + exp(-g)) * u;
#elif defined(OP_CLAMPED_SWIGLU)
    g = min(g, pc.param);
    u = clamp(u, -pc.param, pc.param);
    y[i] = g / (1.0 + exp(-pc.alpha * g)) * (u + 1.0);
#else
    y[i] = gelu_tanh_mul(g, u);
#endif
#endif
}
