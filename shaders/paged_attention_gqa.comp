#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_arithmetic : require
//! variants: KV=f32,f16,q8_0 ACCESS=texel,ssbo
// paged_attention for GQA models, every step: the math and the buffers are paged_attention.comp's
// (same bindings, window, softcap and chunk rules, padding rows); what differs is who loads what.
// One workgroup = one subgroup of LANES invocations owns a tile: TOKENS consecutive tokens x HEADS
// query heads that share one KV head. Lane l folds, for every row of the tile, the positions
// range.x + l, range.x + l + LANES, ... of each chunk of the row's window, exactly the positions
// and order paged_attention.comp's SPLIT_SUB lane l folds for that row, with the same functions
// (include/attention.glsl: score, online-softmax update, lane merge, chunk merge, all `precise`),
// so a row's output is bit-identical to that kernel's and depends only on the device and its own
// sequence. A key / value row is loaded once per tile for all its rows instead of once per row (a
// third of the loads for 3 heads). The rows' online-softmax states stay in registers; scores exist
// one at a time. Keys and values are not staged in shared memory: on llvmpipe shared-memory loads
// measured ~20x slower than texel loads (docs/ARCHITECTURE.md), and the lanes read disjoint
// positions, so there is nothing to share across lanes.
// Chunks (CHUNK > 0, specialisation constant 3): with pc.chunks == 1 a tile walks every chunk
// its window touches and merges them in registers; with pc.chunks > 1 (decode-shaped steps)
// tile i (of one token) walks chunk i % pc.chunks alone and stores its rows' partial states
// for paged_attention_merge.comp (the layout of paged_attention.comp's partials). Everything that
// changes per step (positions, seq_index, block_table) is read from buffers: a recorded step
// can be replayed.
#include "access.glsl"
DECLARE_LOCAL_SIZE;
layout(constant_id = 0) const uint LANES = 8u;  // = the workgroup size = the subgroup size
layout(constant_id = 1) const uint HD4 = 16;    // head_dim / 4
layout(constant_id = 2) const float SOFTCAP = 0.0;
layout(constant_id = 3) const uint CHUNK = 0u;  // positions per chunk; 0: one chunk
// The tile's height is constant so its loops unroll and every row's state is addressed by a
// constant index: llvmpipe then keeps it in registers (indexed at run time it went to memory
// and the kernel ran 5x slower than the paged one).
layout(constant_id = 4) const uint HEADS = 1u;  // query heads per tile, all of one KV head
// Tokens per tile (prefill-shaped steps; 1 otherwise): consecutive tokens of the step. Where
// they share a sequence and a window start (a prompt's neighbouring tokens), one walk serves
// them all: the positions every one of them sees are folded for all rows at once, then the few
// the later tokens alone see (positions past an earlier token's end) with the earlier tokens'
// rows held unchanged, so each row folds exactly its own positions, on the same lanes in the
// same order as alone. Tokens that share no walk (a sequence boundary, a padding row, sliding
// windows) walk one after another: every walk resets the running states and merges only its
// own rows, so the rows it does not own may fold anything meanwhile. A row's bits never depend
// on its tile partners.
layout(constant_id = 5) const uint TOKENS = 1u;
// Attention sinks, as paged_attention.comp takes them (binding 7; off, unread).
layout(constant_id = 6) const bool SINKS = false;

IN_F32X4(0, q);
#define KV_F16_WIDE  // the host binds 8 halves per texel (head_dim a multiple of 8)
#include "kv_cache.glsl"
IN_I32(3, block_table);
IN_I32(4, seq_index);
IN_I32(5, positions);
OUT_F32X4(6, o);
IN_F32(7, sinks);

// group = num_heads / num_kv_heads (a multiple of HEADS); kv_dim4 = num_kv_heads * head_dim / 4
// (texels per slot); window: 0 = the whole context.
layout(push_constant) uniform Push {
    uint tokens; uint num_heads; uint group; uint kv_dim4;
    uint block_size; uint max_blocks; float scale; uint window;
    uint chunks; uint token0;  // chunks per tile (1: it walks them all; else TOKENS is 1); first token
} pc;

// The rows' states are include/attention.glsl's arrays with a row per (token, query head) of
// the tile (row j * HEADS + g), so a row is folded and merged by the very functions
// paged_attention.comp calls.
const uint ATTENTION_ROWS = HEADS * TOKENS;
vec4 k_row[HD4];  // the key and value row of this lane's current position
vec4 v_row[HD4];
#define ATTENTION_PAGED
#define ATTENTION_SUBGROUP
#include "softcap.glsl"
#include "attention.glsl"

uint token_rows(uint j) { return ((1u << HEADS) - 1u) << (j * HEADS); }  // row bits of token j

void main() {
    uint i = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    uint head_tiles = pc.num_heads / HEADS;
    uint token_tiles = (pc.tokens + TOKENS - 1u) / TOKENS;
    if (i >= token_tiles * head_tiles * pc.chunks) return;  // the whole subgroup leaves together
    uint lane = gl_LocalInvocationID.x;
    uint item = i / pc.chunks;  // (token tile, head tile) of the slab
    uint tile_token = (item / head_tiles) * TOKENS;  // the tile's first token, from the slab's
    uint head0 = (item % head_tiles) * HEADS;
    uint head_texel = (head0 / pc.group) * HD4;
    float q_scale = attention_prescale(pc.scale);
    // Per token of the tile: its sequence (-1: a padding row or past the step's tokens), its
    // context end and window start.
    int seq[TOKENS];
    uint n[TOKENS], first[TOKENS];
    uint real = 0u;  // tokens with a sequence
    [[unroll]] for (uint j = 0u; j < TOKENS; ++j) {
        uint t = pc.token0 + min(tile_token + j, pc.tokens - 1u);
        seq[j] = tile_token + j < pc.tokens ? LD_I32(seq_index, t) : -1;
        n[j] = context_end(t);
        first[j] = window_start(n[j]);
        if (seq[j] >= 0) real |= 1u << j;
        else if (tile_token + j < pc.tokens && lane == 0u && pc.chunks == 1u)  // padding: zeros (split: the merge writes them)
            for (uint g = 0u; g < HEADS; ++g)
                for (uint d = 0u; d < HD4; ++d) o[(t * pc.num_heads + head0 + g) * HD4 + d] = vec4(0.0);
        [[unroll]] for (uint g = 0u; g < HEADS; ++g) {
            attend_load_q(j * HEADS + g, (t * pc.num_heads + head0 + g) * HD4, q_scale);
            merged_reset(j * HEADS + g);
        }
    }
    // Walks: the lowest token not walked yet, with every later one of its sequence and window.
    uint walked = ~real & ((1u << TOKENS) - 1u);
    [[dont_unroll]] while (walked != (1u << TOKENS) - 1u) {
        uint lead = findLSB(~walked);
        uint walk = 0u, end_all = n[lead], end_any = n[lead];
        [[unroll]] for (uint j = 0u; j < TOKENS; ++j)
            if ((walked >> j & 1u) == 0u && seq[j] == seq[lead] && first[j] == first[lead]) {
                walk |= 1u << j;
                end_all = min(end_all, n[j]);
                end_any = max(end_any, n[j]);
            }
        walked |= walk;
        uvec2 span = pc.chunks > 1u ? uvec2(i % pc.chunks) : chunk_span(first[lead], end_any);
        uint table_row = uint(seq[lead]) * pc.max_blocks;
        for (uint c = span.x; c <= span.y; ++c) {
            uvec2 range = chunk_range(first[lead], end_any, c);  // token j's: [range.x, min(n[j], range.y))
            if (range.x >= range.y) return;  // a split tile whose chunk the window misses (uniform; TOKENS 1)
            // Every row's running state starts here; only the walk's rows are merged below, so
            // the other rows' running states are dead and may take any position.
            [[unroll]] for (uint r = 0u; r < ATTENTION_ROWS; ++r) attend_reset(r);
            uint shared_end = min(end_all, range.y);
            uint p = range.x + lane;  // = b * block_size + off
            uint b = p / pc.block_size, off = p % pc.block_size;
            for (; p < shared_end; p += LANES)  // positions every token of the walk sees
                attend_position(next_texel(table_row, head_texel, b, off, LANES));
            // Rows of the walk's tokens that still see p (a tile of one token saw them all).
            if (TOKENS > 1u) for (; p < range.y; p += LANES) {
                uint rows = 0u;
                [[unroll]] for (uint j = 0u; j < TOKENS; ++j)
                    if ((walk >> j & 1u) != 0u && p < n[j]) rows |= token_rows(j);
                attend_position_rows(next_texel(table_row, head_texel, b, off, LANES), rows);
            }
            [[unroll]] for (uint j = 0u; j < TOKENS; ++j) {
                if ((walk >> j & 1u) == 0u || range.x >= n[j]) continue;  // uniform: chunk c is past token j's end
                [[unroll]] for (uint g = 0u; g < HEADS; ++g) {
                    uint r = j * HEADS + g;
                    attend_lanes_merge(r);
                    // partial rows: per (token, head) of the slab, pc.chunks of them
                    uint part = ((tile_token + j) * pc.num_heads + head0 + g) * pc.chunks + c;
                    if (pc.chunks > 1u) attend_store_partial(r, part * (HD4 + 1u));
                    else merge_chunk(r);
                }
            }
        }
    }
    if (pc.chunks == 1u)
        [[unroll]] for (uint j = 0u; j < TOKENS; ++j)
            if ((real >> j & 1u) != 0u)
                [[unroll]] for (uint g = 0u; g < HEADS; ++g) {
                    if (SINKS) merge_sink(j * HEADS + g, LD_F32(sinks, head0 + g));
                    attend_store_merged(j * HEADS + g, ((pc.token0 + tile_token + j) * pc.num_heads + head0 + g) * HD4);
                }
}
