#version 450
#extension GL_GOOGLE_include_directive : require
//! variants: OP=router,router_sigmoid,combine,combine_shared,bias,scale ACCESS=texel,ssbo
// Mixture-of-experts routing and combine (vkrt/ops/moe.py has the references).
// OP_ROUTER: one invocation per token of logits [T, E]. The k picks are made in order, each
// the largest logit ranked after the previous pick in the order (logit descending, expert
// index ascending), so equal logits go to the lower index, as the reference's stable sort
// does, and no per-token mask is needed (k passes over E logits). Weights are the picks'
// softmax probabilities over all E (max subtracted, exps summed in index order), divided by
// their sum when NORMALIZE (norm_topk_prob). ids and weights are written as [T, k].
// OP_ROUTER_SIGMOID: the same walk over rank = sigmoid(logit) + bias[e] (the expert bias steers
// the choice only), over the experts of the top_groups best of `groups` consecutive groups (each
// valued by its two best ranks; the groups are picked by the same walk); the weights are the
// picks' sigmoid(logit), divided by their sum + norm_eps when NORMALIZE, then times pc.scale
// (routed_scaling_factor).
// OP_COMBINE: one invocation per output element of [T, N]: sum over slots j = 0..k-1 of
// weights[t, j] * y[t, j, n], in slot order (a fixed order per element: batch invariant).
// OP_COMBINE_SHARED: the same, then + sigmoid(shared_logit[t]) * shared[t, n] (a shared
// expert, Qwen2-MoE's).
// OP_BIAS: one invocation per element of y [T, k, N]: y[t, j, n] + bias[ids[t, j], n], each
// chosen expert's own bias (gpt-oss), one rounded f32 add. OP_SCALE: the same with
// y[t, j, n] * scale[ids[t, j], n], one rounded f32 product (Gemma 4's per-expert scale of the
// chosen weights: N = 1).
#include "access.glsl"
DECLARE_LOCAL_SIZE;

#ifdef OP_ROUTER
IN_F32(0, logits);
OUT_I32(1, ids);
RW_F32(2, weights);
layout(push_constant) uniform Push { uint T; uint E; uint k; uint normalize; } pc;

void main() {
    uint t = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (t >= pc.T) return;
    uint base = t * pc.E;
    float m = -1.0 / 0.0;
    for (uint e = 0u; e < pc.E; e++) m = max(m, LD_F32(logits, base + e));
    precise float total = 0.0;
    for (uint e = 0u; e < pc.E; e++) total += exp(LD_F32(logits, base + e) - m);
    float prev = 1.0 / 0.0;
    int prev_id = -1;
    precise float chosen = 0.0;
    for (uint j = 0u; j < pc.k; j++) {
        int best = -1;
        float best_v = -1.0 / 0.0;
        for (uint e = 0u; e < pc.E; e++) {
            float v = LD_F32(logits, base + e);
            bool after = v < prev || (v == prev && int(e) > prev_id);  // ranked after the last pick
            if (after && (best < 0 || v > best_v)) {
                best = int(e);
                best_v = v;
            }
        }
        best = max(best, 0);  // only NaN logits leave no pick; keep the id in range
        precise float p = exp(best_v - m) / total;
        ids[t * pc.k + j] = best;
        weights[t * pc.k + j] = p;
        chosen += p;
        prev = best_v;
        prev_id = best;
    }
    if (pc.normalize != 0u) {
        for (uint j = 0u; j < pc.k; j++) weights[t * pc.k + j] = weights[t * pc.k + j] / chosen;
    }
}
#endif

#ifdef OP_ROUTER_SIGMOID
IN_F32(0, logits);
IN_F32(1, bias);
OUT_I32(2, ids);
RW_F32(3, weights);
layout(push_constant) uniform Push {
    uint T; uint E; uint k; uint normalize; float scale; float norm_eps; uint groups; uint top_groups;
} pc;

float sigmoid_of(float x) { return 1.0 / (1.0 + exp(-x)); }
float rank_of(uint base, uint e) { return sigmoid_of(LD_F32(logits, base + e)) + LD_F32(bias, e); }

// A group's value: the sum of its two best ranks (equal ranks count twice, as topk(2) takes them).
float group_value(uint base, uint first, uint size) {
    float best = -1.0 / 0.0, second = -1.0 / 0.0;
    for (uint e = first; e < first + size; e++) {
        float v = rank_of(base, e);
        if (v > best) {
            second = best;
            best = v;
        } else if (v > second) {
            second = v;
        }
    }
    return best + second;
}

void main() {
    uint t = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (t >= pc.T) return;
    uint base = t * pc.E;
    uint size = pc.E / pc.groups;
    uint allowed = 0xffffffffu;  // bit g: group g's experts may be chosen
    if (pc.groups > 1u) {  // the top_groups best groups, picked in order as the experts are below
        allowed = 0u;
        float prev = 1.0 / 0.0;
        int prev_id = -1;
        for (uint j = 0u; j < pc.top_groups; j++) {
            int best = -1;
            float best_v = -1.0 / 0.0;
            for (uint g = 0u; g < pc.groups; g++) {
                float v = group_value(base, g * size, size);
                bool after = v < prev || (v == prev && int(g) > prev_id);
                if (after && (best < 0 || v > best_v)) {
                    best = int(g);
                    best_v = v;
                }
            }
            best = max(best, 0);
            allowed |= 1u << uint(best);
            prev = best_v;
            prev_id = best;
        }
    }
    float prev = 1.0 / 0.0;
    int prev_id = -1;
    precise float chosen = 0.0;
    for (uint j = 0u; j < pc.k; j++) {
        int best = -1;
        float best_v = -1.0 / 0.0, best_w = 0.0;
        for (uint e = 0u; e < pc.E; e++) {
            if (((allowed >> (e / size)) & 1u) == 0u) continue;
            float w = sigmoid_of(LD_F32(logits, base + e));
            float v = w + LD_F32(bias, e);
            bool after = v < prev || (v == prev && int(e) > prev_id);  // ranked after the last pick
            if (after && (best < 0 || v > best_v)) {
                best = int(e);
                best_v = v;
                best_w = w;
            }
        }
        best = max(best, 0);  // only NaN logits leave no pick; keep the id in range
        ids[t * pc.k + j] = best;
        weights[t * pc.k + j] = best_w;
        chosen += best_w;
        prev = best_v;
        prev_id = best;
    }
    precise float denominator = pc.normalize != 0u ? chosen + pc.norm_eps : 1.0;
    for (uint j = 0u; j < pc.k; j++) weights[t * pc.k + j] = weights[t * pc.k + j] / denominator * pc.scale;
}
#endif

#if defined(OP_COMBINE) || defined(OP_COMBINE_SHARED)
IN_F32(0, y);        // [T, k, N]
IN_F32(1, weights);  // [T, k]
OUT_F32(2, mixed);   // [T, N]
#ifdef OP_COMBINE_SHARED
IN_F32(3, shared_y);      // [T, N]
IN_F32(4, shared_logit);  // [T, 1]
#endif
layout(push_constant) uniform Push { uint T; uint N; uint k; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.T * pc.N) return;
    uint t = i / pc.N, n = i % pc.N;
    precise float acc = 0.0;
    for (uint j = 0u; j < pc.k; j++) acc = fma(LD_F32(weights, t * pc.k + j), LD_F32(y, (t * pc.k + j) * pc.N + n), acc);
#ifdef OP_COMBINE_SHARED
    precise float gate = 1.0 / (1.0 + exp(-LD_F32(shared_logit, t)));
    acc = fma(gate, LD_F32(shared_y, i), acc);
#endif
    mixed[i] = acc;
}
#endif

#if defined(OP_BIAS) || defined(OP_SCALE)
IN_F32(0, y);     // [T, k, N]
IN_F32(1, bias);  // [E, N]: the experts' biases, or their scales
IN_I32(2, ids);   // [T, k]
OUT_F32(3, biased);
layout(push_constant) uniform Push { uint rows; uint N; } pc;  // rows = T * k

void main() {
    uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (i >= pc.rows * pc.N) return;
    uint row = i / pc.N, n = i % pc.N;
    float own = LD_F32(bias, uint(LD_I32(ids, row)) * pc.N + n);
#ifdef OP_SCALE
    biased[i] = LD_F32(y, i) * own;
#else
    biased[i] = LD_F32(y, i) + own;
#endif
}
#endif
