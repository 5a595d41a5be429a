// One (token, head) of attention with an online softmax, in registers.
// The including shader declares `layout(constant_id = 1) const uint HD4` (head_dim / 4) and
// defines LD_K(i), LD_V(i): the vec4 of keys / values at texel index i. Positions are folded
// in the order the shader visits them; that order alone fixes the rounding, so a token's
// output is the same whatever else shares the dispatch (batch invariance).
// A shader that defines SCORE_SOFTCAP (a specialisation constant; 0 = off) and includes
// softcap.glsl gets scores c * tanh(score / c): q_reg is then pre-scaled by `scale` only and
// each capped score is moved into the exp2 domain here.

const float LOG2E = 1.4426950408889634;

vec4 q_reg[HD4];    // the query, pre-scaled by scale * log2(e) so the softmax can use exp2
                    // (by scale alone under SCORE_SOFTCAP > 0)
vec4 acc[HD4];      // sum over positions of exp2(score - run_max) * v
float run_max;      // largest score so far
float run_sum;      // sum over positions of exp2(score - run_max)

// Reset the running state; the shader then fills q_reg.
void attend_begin() {
    for (uint d = 0u; d < HD4; ++d) acc[d] = vec4(0.0);
    run_max = uintBitsToFloat(0xFF800000u);  // -inf: the first position sets it
    run_sum = 0.0;
}

// Fold in the position whose key and value rows start at texel `row`.
void attend_position(uint row) {
    float score = 0.0;
    for (uint d = 0u; d < HD4; ++d) score += dot(q_reg[d], LD_K(row + d));
#ifdef SCORE_SOFTCAP
    if (SCORE_SOFTCAP > 0.0) score = softcap_f32(score, SCORE_SOFTCAP) * LOG2E;
#endif
    if (score > run_max) {  // rescale the running sums to the new maximum
        float shrink = exp2(run_max - score);
        run_sum *= shrink;
        for (uint d = 0u; d < HD4; ++d) acc[d] *= shrink;
        run_max = score;
    }
    float weight = exp2(score - run_max);
    run_sum += weight;
    for (uint d = 0u; d < HD4; ++d) acc[d] += weight * LD_V(row + d);
}
