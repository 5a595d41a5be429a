#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
//! variants: ACCESS=texel,ssbo
// sample_top_k over logits [rows, n] and a token mask [rows, ceil(n / 32)] -> i32 [rows]; the
// spec, bit for bit, is the numpy reference in vkrt/ops/sampling.py. Every read of a logit
// goes through logit(), which reads a token the mask disallows as -inf. One row per workgroup of ROW_LANES (W) lanes; lane l
// owns columns l, l + W, l + 2W, ...:
// 1. a lower bound for the row's k-th best: each lane's q-th best (q = ceil(k / W)) from a
//    sorted register network, minimised over the lanes;
// 2. each lane keeps its k best columns at or above the bound in a sorted list, in argmax
//    order (larger first, NaN first, lower index on ties);
// 3. k rounds of workgroup_argmax over the lists' heads yield the k candidates in order;
//    the winner's lane (its index mod W) pops its head;
// 4. lane 0 weighs the candidates and draws, in the reference's order of float32 operations;
//    a row whose best candidate is not finite gets -1.
// Selection is exact, so the ids depend on nothing but the row: not on the batch (ARCHITECTURE.md
// invariant 9), nor on W. Arithmetic feeding a weight or sum is `precise` (no fma).
#include "access.glsl"
#include "reduce.glsl"
DECLARE_LOCAL_SIZE;

IN_F32(0, logits);
IN_F32X4(1, params);  // (inv_temperature, top_p, min_p, top_k) per row
IN_F32(2, uniforms);
IN_U32(3, mask);  // bit j % 32 of word j / 32 of the row allows token j (structured output)
OUT_I32(4, ids);

layout(push_constant) uniform Push { uint rows; uint n; } pc;

const uint MAX_TOP_K = 64u;  // = vkrt.ops.sampling.MAX_TOP_K
const uint NONE = 0xFFFFFFFFu;
#define LOG2E uintBitsToFloat(0x3FB8AA3Bu)
#define U_MAX uintBitsToFloat(0x3F7FFFFFu)  // the largest float below 1
const uint BOUND_REGS = 8u;  // q <= 8 covers every k from W = 8 up; rows with q > 8 skip step 1
const uint CHUNK = 32u;  // columns per lane scanned between insertions (= kernels/sample.py)
// Shared memory: 4 (2 MAX_TOP_K W + CHUNK W + 2 MAX_TOP_K + 2 W) bytes with reduce.glsl's;
// kernels/sample.py halves W until it fits.
// Lane l's list entry s sits at [s * W + l]; lists live here, not in private arrays, because
// dynamically indexed private arrays spill on GPUs (on llvmpipe both measured the same).
shared float list_v[MAX_TOP_K * ROW_LANES];
shared uint list_i[MAX_TOP_K * ROW_LANES];
shared uint pending[CHUNK * ROW_LANES];  // columns noted in the current chunk
shared float cand_weight[MAX_TOP_K];  // lane 0's candidates: weight (-1: min-p dropped), id
shared uint cand_index[MAX_TOP_K];

// 2**t for t <= 0: exact split t = n + f, Horner for 2**f, exact scaling; 0 below 2**-126.
float exp2_weight(float t) {
    if (!(t >= -126.0)) return 0.0;  // also NaN
    float n = floor(t);
    precise float f = t - n;
    precise float q = uintBitsToFloat(0x3962A320u);
    q = q * f + uintBitsToFloat(0x3AA36993u);
    q = q * f + uintBitsToFloat(0x3C1E8620u);
    q = q * f + uintBitsToFloat(0x3D634478u);
    q = q * f + uintBitsToFloat(0x3E75FEADu);
    q = q * f + uintBitsToFloat(0x3F317216u);
    q = q * f + 1.0;
    precise float w = q * uintBitsToFloat(uint(int(n) + 127) << 23);
    return w;
}

#define LIST(s) ((s) * ROW_LANES + lane)

// Column j of the row starting at `base` (row `row`), -inf where the row's mask clears its bit.
float logit(uint row, uint base, uint j) {
    uint word = LD_U32(mask, row * ((pc.n + 31u) / 32u) + j / 32u);
    return (word >> (j % 32u) & 1u) != 0u ? LD_F32(logits, base + j) : -1.0 / 0.0;
}

void main() {
    uint row = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (row >= pc.rows) return;  // the whole workgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint base = row * pc.n;
    vec4 sp = LD_F32X4(params, row);  // (inv_temperature, top_p, min_p, top_k)
    uint k = uint(clamp(int(sp.w), 1, int(min(MAX_TOP_K, pc.n))));

    // 1. Lane bounds: with NaN as +inf, each lane has >= q columns at or above its q-th
    // best, so >= W q >= k columns of the row reach the smallest: every candidate does.
    // It cuts list insertions from ~k ln(n / Wk) per lane to ~q (k = 40: 5.9 -> 2.1 ms for
    // 8 rows of 49152 on llvmpipe). Greedy rows (k = 1) skip it: they insert ~ln(n / W).
    float bound = -1.0 / 0.0;
    uint q = (k + ROW_LANES - 1u) / ROW_LANES;
    if (k > 1u && q <= BOUND_REGS) {
        float best[BOUND_REGS];  // sorted, largest first; registers once unrolled
        [[unroll]] for (uint r = 0u; r < BOUND_REGS; r++) best[r] = -1.0 / 0.0;
        for (uint j = lane; j < pc.n; j += ROW_LANES) {
            float v = logit(row, base, j);
            float c = isnan(v) ? 1.0 / 0.0 : v;
            if (!(c > best[BOUND_REGS - 1u])) continue;  // the common case after warm-up
            [[unroll]] for (uint r = 0u; r < BOUND_REGS; r++) {
                float hi = max(best[r], c);
                c = min(best[r], c);
                best[r] = hi;
            }
        }
        float lane_bound = best[0];
        [[unroll]] for (uint r = 1u; r < BOUND_REGS; r++) lane_bound = r < q ? best[r] : lane_bound;
        bound = -workgroup_max(-lane_bound);
    }

    // 2. This lane's k best, sorted; empty slots hold (-inf, NONE), which loses to every
    // column. (tail_v, tail_i) is the k-th entry, the bar to enter. Columns come in
    // increasing index order, so one that ties with the tail never enters.
    for (uint s = 0u; s < k; s++) {
        list_v[LIST(s)] = -1.0 / 0.0;
        list_i[LIST(s)] = NONE;
    }
    float tail_v = -1.0 / 0.0;
    uint tail_i = NONE;
    for (uint chunk = lane; chunk < pc.n; chunk += CHUNK * ROW_LANES) {
        // The scan only notes columns that pass the bound and the tail as it stood when the
        // chunk began; inserting inline measured 3x slower on llvmpipe even when nothing
        // entered (the masked insertion loop ran for every column).
        uint count = 0u;
        uint end = min(pc.n, chunk + CHUNK * ROW_LANES);
        for (uint j = chunk; j < end; j += ROW_LANES) {
            float v = logit(row, base, j);
            if (isnan(v) || (v >= bound && (v > tail_v || tail_i == NONE))) {
                pending[LIST(count)] = j;
                count++;
            }
        }
        for (uint c = 0u; c < count; c++) {
            uint j = pending[LIST(c)];
            float v = logit(row, base, j);
            if (!argmax_beats(v, j, tail_v, tail_i)) continue;
            uint s = k - 1u;
            for (; s > 0u && argmax_beats(v, j, list_v[LIST(s - 1u)], list_i[LIST(s - 1u)]); s--) {
                list_v[LIST(s)] = list_v[LIST(s - 1u)];
                list_i[LIST(s)] = list_i[LIST(s - 1u)];
            }
            list_v[LIST(s)] = v;
            list_i[LIST(s)] = j;
            tail_v = list_v[LIST(k - 1u)];
            tail_i = list_i[LIST(k - 1u)];
        }
    }

    // 3. Merge: round r's winner is candidate r. The lists hold the row's top k, so every
    // winner is a real column. Lane 0 weighs each as it comes (step 2 of the spec) and sums
    // the min-p-kept weights in candidate order.
    uint head = 0u;
    float top = 0.0;
    float scale = sp.x * LOG2E;
    precise float total = 0.0;
    for (uint r = 0u; r < k; r++) {
        bool has = head < k;
        uint at = LIST(min(head, k - 1u));
        uint winner = workgroup_argmax(has ? list_v[at] : -1.0 / 0.0, has ? list_i[at] : NONE);
        if (winner % ROW_LANES == lane) head++;
        if (lane == 0u) {
            float v = logit(row, base, winner);
            if (r == 0u) top = v;
            precise float t = (v - top) * scale;
            float w = r == 0u ? 1.0 : exp2_weight(t);
            bool kept = r == 0u || w >= sp.z;  // the top candidate always stays
            cand_weight[r] = kept ? w : -1.0;
            cand_index[r] = winner;
            if (kept) total = total + w;
        }
    }
    if (lane != 0u) return;  // no barrier follows
    // No distribution to draw from: the best allowed logit is NaN or +-inf (NONFINITE).
    if (isnan(top) || isinf(top)) {
        ids[row] = -1;
        return;
    }

    // 4. Top-p: kept candidates up to the first whose running sum reaches top_p * total;
    // then the first whose running sum exceeds u * (that sum).
    precise float cut = sp.y * total;
    precise float mass = 0.0;
    uint last = 0u;
    for (uint r = 0u; r < k; r++) {
        if (cand_weight[r] < 0.0) continue;
        mass = mass + cand_weight[r];
        last = r;
        if (mass >= cut) break;
    }
    precise float target = clamp(LD_F32(uniforms, row), 0.0, U_MAX) * mass;
    precise float running = 0.0;
    uint token = cand_index[last];
    for (uint r = 0u; r <= last; r++) {
        if (cand_weight[r] < 0.0) continue;
        running = running + cand_weight[r];
        if (running > target) {
            token = cand_index[r];
            break;
        }
    }
    ids[row] = int(token);
}
