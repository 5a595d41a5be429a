// Row tiles of weight matrices (vkrt/backend/vulkan/kernels/layouts.py): rows come in tiles
// of TILE; within a tile, unit u (a 32-value block, or a 256-value super-block for q6_k and
// the K-quants' scales) of all TILE rows precedes unit u + 1. `tiled` is the position of
// (row, unit u) in a region of `per` words or texels per unit and `units` units per row; a
// row's next unit is TILE * per further on.

#ifndef VKRT_TILES_GLSL
#define VKRT_TILES_GLSL

layout(constant_id = 7) const uint TILE = 64u;  // layouts.TILE_ROWS, set by the host

uint tiled(uint row, uint units, uint u, uint per) {
    return ((row / TILE) * units + u) * TILE * per + (row % TILE) * per;
}

#endif  // VKRT_TILES_GLSL
