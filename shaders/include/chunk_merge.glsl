// Merging the softmax states of a row's chunks (flash-decoding), in chunk order: the one
// definition paged_attention_merge.comp (chunks stored as partials by separate workgroups)
// and include/attention.glsl (a workgroup walking a row's chunks itself) both use, so a row's
// result has the same bits whichever way its chunks were walked.

#define NEG_INF uintBitsToFloat(0xFF800000u)

// The weights that bring a merged state of maximum m_merged and the next chunk's state of
// maximum m to their common maximum, for merged = merged * w.x + chunk * w.y (each product and
// sum rounded as written, `precise`); the larger side weighs exactly 1. The first chunk is
// taken as it is (not weighed), so a row whose window lies in one chunk gets an unsplit walk's
// bits.
vec2 merge_weights(float m_merged, float m) {
    float top = max(m_merged, m);
    return vec2(m_merged == top ? 1.0 : exp2(m_merged - top), m == top ? 1.0 : exp2(m - top));
}
