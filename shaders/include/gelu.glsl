// gelu_tanh(g) * u, GeGLU's gate, shared by elementwise.comp's gelu_mul and matmul_vec.comp's
// gated epilogue so both compute it identically: `precise` keeps each product and sum
// rounded as written (no fused multiply-adds that one shader's compile contracts and the
// other's does not). 0.5 * g * (1 + tanh(z)) == g * sigmoid(2z): no cancellation where
// tanh(z) -> -1.
float gelu_tanh_mul(float g, float u) {
    precise float g3 = g * g * g;
    precise float z = 0.7978845608028654 * (g + 0.044715 * g3);
    precise float y = g / (1.0 + exp(-2.0 * z)) * u;
    return y;
}
