// A row's chunks (flash-decoding) and the merge of their softmax states, in chunk order: the
// one definition paged_attention_merge.comp (chunks stored as partials by separate workgroups)
// and include/attention.glsl (a workgroup walking a row's chunks itself) both use, so a row's
// result has the same bits whichever way its chunks were walked.

#define NEG_INF uintBitsToFloat(0xFF800000u)
const float LOG2E = 1.4426950408889634;

// A row's window and chunks, which the attention kernels and the merge pass must agree on: the
// end n of the context of a token at `position`, never past the block table's
// table_positions whatever the position says; the first position a sliding window (0: none)
// lets it see; the chunks of `chunk` positions (0: one chunk) that window touches. A window with
// the CHUNKED_WINDOW bit set is chunk-aligned (Llama 4's chunked attention): its W = the other bits
// and it starts at the multiple of W the row ends in, floor((n - 1) / W) * W.
const uint CHUNKED_WINDOW = 0x80000000u;
uint row_end(int position, uint table_positions) { return min(uint(position) + 1u, table_positions); }
uint row_first(uint n, uint window) {
    uint w = window & ~CHUNKED_WINDOW;
    if (w != window) return n > 0u ? (n - 1u) / w * w : 0u;
    return window > 0u && n > window ? n - window : 0u;
}
uvec2 row_chunks(uint first, uint n, uint chunk) { return chunk > 0u ? uvec2(first / chunk, (n - 1u) / chunk) : uvec2(0u); }

// The weights that bring a merged state of maximum m_merged and the next chunk's state of
// maximum m to their common maximum, for merged = merged * w.x + chunk * w.y (each product and
// sum rounded as written, `precise`); the larger side weighs exactly 1. The first chunk is
// taken as it is (not weighed), so a row whose window lies in one chunk gets an unsplit walk's
// bits.
vec2 merge_weights(float m_merged, float m) {
    float top = max(m_merged, m);
    return vec2(m_merged == top ? 1.0 : exp2(m_merged - top), m == top ? 1.0 : exp2(m - top));
}

// An attention sink (gpt-oss: a learned logit sink_logit in the softmax's denominator that weighs
// no value) folded into a row's merged state of maximum m and sum s as one more chunk of maximum
// sink_logit * log2 e, sum 1 and no values: returns (the weight of the state's sum and values,
// the new sum). The new maximum is not needed: nothing is merged after the sink.
vec2 sink_merge(float m, float s, float sink_logit) {
    precise float sink = sink_logit * LOG2E;
    vec2 w = merge_weights(m, sink);
    precise float sum = s * w.x + w.y;
    return vec2(w.x, sum);
}
