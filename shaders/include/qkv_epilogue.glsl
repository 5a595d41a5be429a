// The attention prologue as a matmul epilogue (matmul_vec.comp EPILOGUE=qkv): the
// stacked q|k|v projection is computed, q and k are roped, q is written out and rope(k), v
// go to the token's KV-cache slot, all from registers. Bit-identical to the matmul followed
// by qkv_rope.comp: each row is reduced exactly as the plain matmul reduces it, the rotation
// is include/rope.glsl's and the f16 encoding qkv_rope.comp's expression.
//
// An invocation owns ROWS = 8 rows chosen so that every rotation partner, and every f16
// word's two halves, are among its own 8 (qkv_row below): the "slot" s = 8 g + r (group g,
// lane-row r) maps to a row of head g / (D / 8). v heads, the interleaved rotation and the
// unrotated tail of a partial rotary head take 8 consecutive dims; a NeoX-rotated group
// takes 4 dims from each half of the rotated part (r < 4: dims 4 i + r, r >= 4: their
// partners half + 4 i + r - 4), so a partner is lane-row r ^ 4 (interleaved: r ^ 1).
// The kernel checks the shapes this needs: D % 8 == 0 and, for NeoX, rot_dim % 8 == 0.
//
// The including shader declares the bindings positions, cos_sin, k_cache, v_cache, slots,
// the output y (= q), the push constants H, KVH, D, rot, max_pos, interleaved, and the
// bool spec constant KV_F16 (caches bound as uint words: f16 pairs, or f32 bits).

#include "cast.glsl"
#include "rope.glsl"

// Dim within its head of slot (group gi of the head, lane-row r).
uint qkv_dim(uint head, uint gi, uint r) {
    bool roped = head < pc.H + pc.KVH;
    uint rotated_groups = (roped && pc.interleaved == 0u) ? pc.rot / 8u : 0u;
    if (gi >= rotated_groups) return gi * 8u + r;  // consecutive: v, interleaved, unrotated tail
    return r < 4u ? 4u * gi + r : pc.rot / 2u + 4u * gi + (r - 4u);
}

// The weight row (= qkv column) of slot s.
uint qkv_row(uint s) {
    uint g = s / 8u, per_head = pc.D / 8u;
    uint head = g / per_head;
    return head * pc.D + qkv_dim(head, g % per_head, s % 8u);
}

// Token t's 8 finished values of the invocation whose first slot is s0.
void qkv_epilogue(uint t, uint s0, float v[8]) {
    uint g = s0 / 8u, per_head = pc.D / 8u;
    uint head = g / per_head, gi = g % per_head;
    bool roped = head < pc.H + pc.KVH;
    uint p = rope_position(t, pc.max_pos);
    float o[8];
    uint dim[8];
    [[unroll]] for (uint r = 0u; r < 8u; r++) {
        uint d = qkv_dim(head, gi, r);
        dim[r] = d;
        o[r] = v[r];
        if (roped && d < pc.rot) {
            bool first;
            uint partner_dim;
            uint j = rope_pair(d, pc.rot, pc.interleaved != 0u, first, partner_dim);
            // The partner's value is lane-row r ^ 1's or r ^ 4's (qkv_row's grouping). Selected
            // by value, not by a computed index, so v stays in registers.
            float partner = pc.interleaved != 0u ? v[r ^ 1u] : v[r ^ 4u];
            o[r] = rope_rotate(v[r], partner, p, j, pc.rot, first);
        }
    }
    if (head < pc.H) {
        uint base = t * pc.H * pc.D + head * pc.D;
        [[unroll]] for (uint r = 0u; r < 8u; r++) y[base + dim[r]] = o[r];
        return;
    }
    int slot = LD_I32(slots, t);
    if (slot < 0) return;  // padding: nothing stored
    bool is_k = roped;
    uint kv_head = head - pc.H - (is_k ? 0u : pc.KVH);
    uint base = uint(slot) * pc.KVH * pc.D + kv_head * pc.D;
    if (KV_F16) {
        // Lane-rows r, r + 1 (r even) hold dims d, d + 1 with d even: one cache word.
        [[unroll]] for (uint r = 0u; r < 8u; r += 2u) {
            uint word = f32_bits_to_f16_bits(floatBitsToUint(o[r]))
                      | (f32_bits_to_f16_bits(floatBitsToUint(o[r + 1u])) << 16);
            if (is_k) k_cache[(base + dim[r]) / 2u] = word;
            else v_cache[(base + dim[r]) / 2u] = word;
        }
    } else {
        [[unroll]] for (uint r = 0u; r < 8u; r++) {
            if (is_k) k_cache[base + dim[r]] = floatBitsToUint(o[r]);
            else v_cache[base + dim[r]] = floatBitsToUint(o[r]);
        }
    }
}
