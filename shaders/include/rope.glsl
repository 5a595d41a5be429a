// Rotary embedding, written once for rope.comp, qkv_rope.comp and the matmul epilogue
// (qkv_epilogue.glsl), so that the three round every rotated value alike (the op tests
// compare them with each other bit for bit).
//
// The first rot_dim dims of a head rotate by the angles of the token's position; the rest
// pass through (partial rotary). Pairs are (j, j + rot_dim / 2) for NeoX / rotate-half and
// (2j, 2j + 1) when interleaved (GPT-J); j indexes the pair's frequency. cos_sin
// [max_positions, rot_dim] holds cos in its first half and sin in its second, built on the
// host in float64 (vkrt.ops.rope_cos_sin). Positions come from a buffer, never push
// constants: replayed decode steps rewrite that buffer.
//
// The including shader declares the bindings `positions` (i32) and `cos_sin` (f32).

#ifndef VKRT_ROPE_GLSL
#define VKRT_ROPE_GLSL

// Token t's position, clamped so a bad one reads a wrong angle instead of out of bounds.
uint rope_position(uint t, uint max_positions) {
    return uint(clamp(LD_I32(positions, t), 0, int(max_positions) - 1));
}

// Dim d (< rot_dim) of a head: the frequency index j of its pair (the return value),
// whether d is the pair's first, and the partner's dim.
uint rope_pair(uint d, uint rot_dim, bool interleaved, out bool first, out uint partner) {
    if (interleaved) {
        first = (d & 1u) == 0u;
        partner = first ? d + 1u : d - 1u;
        return d / 2u;
    }
    uint half_rot = rot_dim / 2u;
    first = d < half_rot;
    partner = first ? d + half_rot : d - half_rot;
    return first ? d : d - half_rot;
}

// x rotated with its partner y by pair j's angle at position p.
float rope_rotate(float x, float y, uint p, uint j, uint rot_dim, bool first) {
    float c = LD_F32(cos_sin, p * rot_dim + j);
    float s = LD_F32(cos_sin, p * rot_dim + rot_dim / 2u + j);
    // `precise` forbids fusing into FMAs, so the result rounds like numpy's f32 reference:
    // bit-exact wherever mul and add are correctly rounded (Vulkan requires it).
    precise float out_value = first ? x * c - y * s : x * c + y * s;
    return out_value;
}

#ifdef ROPE_LOAD
// Element i of a row in memory, dim d of its head, after rope: the including shader defines
// ROPE_LOAD(i, d) as its value before rope (a load, or a load and a norm).
float rope_element(uint i, uint d, uint p, uint rot_dim, bool interleaved) {
    if (d >= rot_dim) return ROPE_LOAD(i, d);
    bool first;
    uint partner;
    uint j = rope_pair(d, rot_dim, interleaved, first, partner);
    return rope_rotate(ROPE_LOAD(i, d), ROPE_LOAD(i - d + partner, partner), p, j, rot_dim, first);
}
#endif

#endif  // VKRT_ROPE_GLSL
