"""Every kernel configuration the selection code can choose, for any device.

The Vulkan kernels pick their specialisation constants from `DeviceCaps` (matmul's
`dispatch_config`, which also picks matmul_tiled.comp for a GPU's prefill, the row kernels' `row_workgroup`, `sample_workgroup`, attention's
`paged_split`). This module calls those functions with synthetic capabilities spanning
what Vulkan devices report (device types, vendors, subgroup sizes 1..128 with and without
subgroup arithmetic, the spec's minimum and common workgroup / shared-memory limits), so
the set of configurations is derived from the code, not listed by hand: a new branch in a
selection function adds configurations here, and tests/backend/test_kernel_configs.py runs
each one on llvmpipe (or fails its coverage test when it cannot).

Each family's capability fields are found by recording which attributes its selection
reads; capabilities that agree on those fields choose alike, so one representative per
distinct combination is enough.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from functools import cache, lru_cache
from typing import Any

from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.backend.vulkan.kernels import attention, norm, sample
from vkrt.backend.vulkan.kernels import matmul as mm
from vkrt.core.formats import FLOAT_FORMATS
from vkrt.core.formats import FORMATS as WEIGHT_FORMATS

DEVICE_TYPES = ("cpu", "discrete", "integrated", "virtual", "other")
VENDORS = (0x10DE, 0x1002, 0x8086, 0x106B, 0x13B5, 0x5143, 0x10005)  # NVIDIA AMD Intel Apple ARM Qualcomm Mesa
SUBGROUP_SIZES = (1, 4, 8, 16, 32, 64, 128)
SUBGROUP_OPS = (["basic"], ["basic", "vote", "arithmetic", "ballot", "shuffle"])
MAX_WORKGROUP = (128, 256, 1024)  # 128: the Vulkan minimum for maxComputeWorkGroupInvocations
SHARED_MEMORY = (16384, 32768, 49152, 65536)  # 16 KiB: the Vulkan minimum


def synthetic_caps() -> list[DeviceCaps]:
    """The product of the axes above, as DeviceCaps."""
    out = []
    for dtype, vendor, size, ops, wg, shared in itertools.product(DEVICE_TYPES, VENDORS, SUBGROUP_SIZES,
                                                                   SUBGROUP_OPS, MAX_WORKGROUP, SHARED_MEMORY):
        out.append(DeviceCaps(index=0, name=f"synthetic {dtype} {vendor:#x}", device_type=dtype,
                              vendor_id=vendor, device_id=0, driver_version=0, api_version="1.3.0",
                              pipeline_cache_uuid="", subgroup_size=size, subgroup_ops=list(ops),
                              max_shared_memory=shared, max_workgroup_invocations=wg))
    return out


class _Recording:
    """DeviceCaps stand-in that records the attributes read through it."""

    def __init__(self, caps: DeviceCaps, reads: set[str]) -> None:
        self._caps, self._reads = caps, reads

    def __getattr__(self, name: str) -> Any:
        self._reads.add(name)
        return getattr(self._caps, name)


@cache
def representatives(select: Callable[[Any], Iterable[Any]]) -> tuple[tuple[str, ...], list[DeviceCaps]]:
    """The caps fields `select(caps)` reads, and one synthetic device per distinct value of them.

    `select` is called once per synthetic device (it may call the selection several times);
    the fields read by any call decide the grouping."""
    reads: set[str] = set()
    devices = synthetic_caps()
    for caps in devices:
        for _ in select(_Recording(caps, reads)):
            pass
    names = tuple(f.name for f in fields(DeviceCaps) if f.name in reads)
    groups: dict[tuple, DeviceCaps] = {}
    for caps in devices:
        groups.setdefault(tuple(_hashable(getattr(caps, n)) for n in names), caps)
    return names, list(groups.values())


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def device_fields(caps: DeviceCaps, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(caps, n) for n in names}


# ---------------------------------------------------------------------------- matmul family

# add / bias: matmul_add with a residual [T, N] / a bias [N]; rms_add / rms_bias: the same
# after the folded norm (rms_norm_matmul_add).
MODES = ("matmul", "gated", "rms", "rms_gated", "add", "bias", "rms_add", "rms_bias", "qkv", "qkv16")
QKV_HEADS = (4, 2, 32)  # num_heads, num_kv_heads, head_dim: 256 stacked rows
QKV_ROWS = (QKV_HEADS[0] + 2 * QKV_HEADS[1]) * QKV_HEADS[2]
FLOATS = FLOAT_FORMATS
# Formats whose blocks are 256-value super-blocks (K-quants, IQ4_XS), from the registry.
K_QUANTS = tuple(name for name, f in WEIGHT_FORMATS.items() if f.is_block and f.block_values == 256)
# Shapes: rows around every power of two (the selection's row thresholds), K of 1..131
# blocks (split-K's lanes are a power of two <= the blocks), token counts below, at and above
# each token tile.
GRID_N = tuple(sorted({1, 67} | {(1 << i) + d for i in range(9, 17) for d in (-1, 1)}))
BLOCK_K = tuple(32 * b for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 65, 131))
SUPER_K = tuple(256 * s for s in (1, 2, 3, 4, 17))
FLOAT_K = (20, 37, 100, 250, 500, 1037, 4100)  # partial last blocks; scalar and vec4 loads
GRID_T = (1, 2, 3, 5, 9)
LARGE_K = 4096
MIN_ROWS = 67
LARGE_BYTES = 1 << 20  # weight bytes a large-K run may take (numpy quantizes them)


def grid_k(dtype: str) -> tuple[int, ...]:
    return SUPER_K if dtype in K_QUANTS else FLOAT_K if dtype in FLOATS else BLOCK_K


def weight_bytes(dtype: str, n: int, k: int) -> int:
    f = WEIGHT_FORMATS[dtype]
    return int(n * k * f.block_bytes / f.block_values)


def matmul_config(caps: Any, mode: str, dtype: str, n: int, k: int, t: int) -> mm.MatmulConfig:
    """What matmul-family dispatch runs for this op mode: the vec kernel up to the device's
    token tile, tiled beyond it, exactly as the kernels' `supports` and runners decide."""
    gated = mode in ("gated", "rms_gated")
    rows = 2 * n if gated else n
    tiled = t > mm.max_tokens(caps)
    return mm.dispatch_config(caps, dtype, rows, k, t, tiled, gated, qkv=mode.startswith("qkv"),
                              norm_and_add=mode in ("rms_add", "rms_bias"))


def _matmul_shapes(mode: str, dtype: str) -> Iterable[tuple[int, int, int]]:
    ns = (QKV_ROWS,) if mode.startswith("qkv") else GRID_N
    return itertools.product(ns, grid_k(dtype), GRID_T)


@dataclass(frozen=True)
class MatmulCase:
    """One configuration and the (synthetic device, shapes) that make the selection choose it."""

    mode: str
    dtype: str
    config: mm.MatmulConfig
    device: tuple[tuple[str, Any], ...]  # the caps fields to impose on the test device
    shapes: tuple[tuple[int, int, int], ...]  # (n, k, t): the smallest, and a large-K one if cheap

    @property
    def id(self) -> str:
        c = self.config
        tiled = f"tiled-l{c.lanes}-" if c.shader == "matmul_tiled" else ""
        return f"{self.mode}-{self.dtype}-{tiled}wg{c.workgroup}-r{c.rows}-t{c.tokens}-s{c.split}"


def _probe_matmul(caps: Any) -> Iterable[None]:
    for mode, dtype in itertools.product(("matmul", "gated", "qkv"), ("f32", "q4_1")):
        for n, k, t in ((1, grid_k(dtype)[0], 1), (65537, grid_k(dtype)[-1], 13)):
            matmul_config(caps, mode, dtype, QKV_ROWS if mode.startswith("qkv") else n, k, t)
            yield None


@lru_cache(maxsize=1)
def matmul_reachable() -> dict[tuple[str, str, mm.MatmulConfig], list[tuple[DeviceCaps, tuple[int, int, int]]]]:
    """(mode, dtype, config) -> every (device, (n, k, t)) on the grid that selects it."""
    names, devices = representatives(_probe_matmul)
    out: dict[tuple[str, str, mm.MatmulConfig], list[tuple[DeviceCaps, tuple[int, int, int]]]] = {}
    for caps in devices:
        for mode, dtype in itertools.product(MODES, mm.FORMATS):
            for shape in _matmul_shapes(mode, dtype):
                out.setdefault((mode, dtype, matmul_config(caps, mode, dtype, *shape)), []).append((caps, shape))
    return out


def matmul_fields() -> tuple[str, ...]:
    return representatives(_probe_matmul)[0]


def _case(mode: str, dtype: str, cfg: mm.MatmulConfig, hits: list[tuple[DeviceCaps, tuple[int, int, int]]],
          names: tuple[str, ...]) -> MatmulCase:
    # At least MIN_ROWS outputs per token where the configuration allows: NMSE over one or
    # two outputs is one value's relative error, noise when the value is near zero.
    cost = lambda hit: (hit[1][0] < MIN_ROWS, weight_bytes(dtype, hit[1][0], hit[1][1]) * hit[1][2], hit[1])  # noqa: E731
    caps, small = min(hits, key=cost)
    shapes = [small]
    large = [h for h in hits if h[1][1] >= LARGE_K and h[0] is caps
             and weight_bytes(dtype, h[1][0], h[1][1]) <= LARGE_BYTES]
    if large:
        shapes.append(min(large, key=cost)[1])
    return MatmulCase(mode, dtype, cfg, tuple(device_fields(caps, names).items()), tuple(shapes))


def matmul_coverage(mode: str, dtype: str, cfg: mm.MatmulConfig) -> set[tuple[Any, ...]]:
    """What running (mode, dtype, cfg) covers. Every configuration of every mode, in some
    format (a fused prologue / epilogue is the same code for every format); for plain
    matmul on matmul_vec each format at every lane split and every token tile (a format's
    block decode meets each lane stride and tile; the row loop around it is
    format-independent); and each format on matmul_tiled once (its staging decodes a block
    the same way at every split; tests/ops/test_matmul_tiled.py runs every format at 32)."""
    keys: set[tuple[Any, ...]] = {("config", mode, cfg)}
    if mode == "matmul" and cfg.shader == "matmul_tiled":
        keys.add(("format-tiled", dtype))
    elif mode == "matmul":
        keys |= {("format-split", dtype, cfg.split), ("format-tokens", dtype, cfg.tokens)}
    return keys


@lru_cache(maxsize=1)
def matmul_cases() -> tuple[MatmulCase, ...]:
    """Few cases covering every `matmul_coverage` key: greedily the one covering most keys
    not yet covered, q4_1 (the default model's format) and small shapes first on ties."""
    names = matmul_fields()
    reachable = matmul_reachable()
    todo = set().union(*(matmul_coverage(*key) for key in reachable))
    order = sorted(reachable, key=lambda key: (key[1] != "q4_1", MODES.index(key[0]), key[1], _order(key[2])))
    chosen = []
    while todo:
        best = max(order, key=lambda key: len(matmul_coverage(*key) & todo))
        todo -= matmul_coverage(*best)
        chosen.append(best)
    return tuple(_case(*key, reachable[key], names) for key in
                 sorted(chosen, key=lambda key: (MODES.index(key[0]), key[1], _order(key[2]))))


def _order(cfg: mm.MatmulConfig) -> tuple[str, int, int, int, int]:
    return (cfg.shader, cfg.split, cfg.workgroup, cfg.rows, cfg.tokens)


# ------------------------------------------------------------------------- row kernels etc.

@cache
def _probe(select: Callable[[Any], Any]) -> Callable[[Any], Iterable[Any]]:
    def probe(caps: Any) -> Iterable[Any]:
        yield select(caps)
    return probe


@cache
def reachable(family: str) -> dict[Any, DeviceCaps]:
    """Configuration -> a device that selects it, for `row` (norm lanes),
    `sample` (sample_top_k lanes), `paged` (paged_attention's (variant, lanes)) and `gqa`
    (the GQA attention kernel's lanes, None where it does not run)."""
    select: Callable[[Any], Any] = {"row": norm.row_workgroup, "sample": sample.sample_workgroup,
                                    "paged": attention.paged_split, "gqa": attention.gqa_lanes}[family]
    _, devices = representatives(_probe(select))
    out: dict[Any, DeviceCaps] = {}
    for caps in devices:
        out.setdefault(select(caps), caps)
    return out


def fields_of(family: str) -> tuple[str, ...]:
    select: Callable[[Any], Any] = {"row": norm.row_workgroup, "sample": sample.sample_workgroup,
                                    "paged": attention.paged_split, "gqa": attention.gqa_lanes}[family]
    return representatives(_probe(select))[0]


# -------------------------------------------------------------------- MoE expert matmul

# (tokens, k, experts): a decode step's few pairs and a prefill's many, odd expert counts;
# each plain (moe_matmul) and gated (moe_matmul_gated: half the rows per invocation).
MOE_GRID = ((1, 1, 5), (1, 8, 9), (3, 2, 5), (8, 4, 32), (32, 2, 5), (130, 8, 9))
MOE_MODES = (False, True)  # gated


def _probe_moe(caps: Any) -> Iterable[Any]:
    from vkrt.backend.vulkan.kernels import moe

    for tokens, k, experts in MOE_GRID:
        for gated in MOE_MODES:
            yield moe.expert_config(caps, tokens * k, experts, gated)


@cache
def moe_reachable() -> dict[Any, tuple[DeviceCaps, tuple[int, int, int], bool]]:
    """Expert-matmul configuration -> a device, a (tokens, k, experts) and the mode (gated)
    that select it."""
    from vkrt.backend.vulkan.kernels import moe

    _, devices = representatives(_probe_moe)
    out: dict[Any, tuple[DeviceCaps, tuple[int, int, int], bool]] = {}
    for caps in devices:
        for tokens, k, experts in MOE_GRID:
            for gated in MOE_MODES:
                out.setdefault(moe.expert_config(caps, tokens * k, experts, gated), (caps, (tokens, k, experts), gated))
    return out


def moe_fields() -> tuple[str, ...]:
    return representatives(_probe_moe)[0]
