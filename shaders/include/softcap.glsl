// cap * tanh(x / cap) (Gemma 2's attention-logit and final-logit softcapping) with a tanh
// accurate to a few f32 ulps everywhere: GLSL's tanh may be lowered to
// (e^2x - 1) / (e^2x + 1), which loses relative precision near 0 and can overflow.

// tanh(x): its odd Taylor series through x^11 below |x| = 0.25 (next term < 1e-10 relative),
// else (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 0.61), where 1 - e cancels < 2 bits.
float tanh_f32(float x) {
    float a = abs(x);
    float r;
    if (a < 0.25) {
        float x2 = x * x;
        r = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0
              + x2 * (62.0 / 2835.0 + x2 * (-1382.0 / 155925.0))))));
    } else {
        float e = exp(-2.0 * a);
        r = (1.0 - e) / (1.0 + e);
        r = x < 0.0 ? -r : r;
    }
    return r;
}

float softcap_f32(float x, float cap) { return cap * tanh_f32(x / cap); }
