"""Mixture-of-experts kernels: moe_router, moe_router_sigmoid, moe_combine, moe_add_bias and moe_scale (shaders/moe.comp), moe_matmul and
moe_matmul_gated (shaders/matmul_id.comp, the id-indexed expert matmul; gated: spec constant
GATES = 2, each expert's gate and up rows reduced together and act(g) * u written, as
matmul_vec's gated mode does for a dense MLP).

Routing ids and weights stay in device tensors: the expert matmul reads each pair's
expert from `ids` on the device, so a sparse layer records with no readback and a MoE
decode step replays as one submit like a dense one.

The expert weight [E, N, K] is E matrices one after another, each in matmul_vec's
row-tiled device layout (VulkanBackend.upload_weight), and the shader reduces every
output with the same quant.glsl helpers in the same block order, so a pair's row equals
the dense matmul of its expert's matrix bit for bit whichever work split ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.backend.vulkan.kernels.common import (
    MAX_GROUPS_X,
    KernelBackend,
    backend_of,
    grid_1d,
    local_size,
    module,
)
from vkrt.backend.vulkan.kernels.layouts import (
    LAYOUTS,
    TILE_ROWS,
    device_nbytes,
    quants_bytes,
    row_texels,
)
from vkrt.backend.vulkan.kernels.matmul import max_tokens
from vkrt.core.tensor import Tensor, TensorSpec

# The formats shaders/matmul_id.comp's variants line lists (a test keeps the two equal).
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k",
           "q6_k", "iq4_xs", "mxfp4")


@dataclass(frozen=True)
class ExpertConfig:
    """Specialisation constants of one expert-matmul dispatch."""

    workgroup: int
    rows: int  # weight rows per invocation
    tokens: int  # pairs reduced together per pass (by_expert), else 1
    by_expert: bool  # workgroup y = expert (gather its pairs), else y = pair


def expert_config(caps: DeviceCaps, pairs: int, experts: int, gated: bool = False) -> ExpertConfig:
    """The work split for `pairs` (token, chosen expert) pairs over `experts` experts.

    Per pair while pairs are few (a decode step: each pair is one matvec, nothing to share);
    by expert once there are at least two pairs per expert on average (prefill), so each
    decoded weight block serves up to `tokens` pairs, as matmul_vec's token tiles do.
    Both reduce every output in the same order (the results are bit-identical). Gated, an
    invocation streams `rows` gate and `rows` up rows, so `rows` is halved (as matmul's)."""
    by_expert = pairs >= 2 * experts
    if caps.device_type == "cpu":
        # llvmpipe: 8 lanes (one AVX2 register), 8 weight rows as matmul_vec's default for
        # matrices of an expert's size (<= 1280 rows); not tuned separately yet.
        rows, workgroup = 8, 8
    else:  # GPUs (unmeasured): one invocation per 2 weight rows, 64 lanes per workgroup.
        rows, workgroup = 2, 64
    return ExpertConfig(workgroup, max(1, rows // 2) if gated else rows, max_tokens(caps) if by_expert else 1,
                        by_expert)


def binding_limit(caps: DeviceCaps) -> int:
    """The most bytes of an expert weight one dispatch binds whole on the current access path
    (the scales view reads it as 4-byte texels)."""
    return 4 * caps.max_texel_elements if caps.access_path == "texel" else caps.max_storage_range


def _fits(backend: KernelBackend, w: Tensor, x: Tensor) -> bool:
    caps = backend.caps
    x_limit = caps.max_texel_elements if caps.access_path == "texel" else caps.max_storage_range // 4
    return w.handle.size <= binding_limit(caps) and x.numel <= x_limit


def _matmul_supports(inputs: tuple[Tensor, ...], params: dict[str, Any]) -> bool:
    x, w, _ = inputs
    return w.dtype in FORMATS and _fits(backend_of(w), w, x)


def _run_matmul(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, w, ids = inputs
    return (dispatch_expert_matmul(backend, x, w, ids),)


def _run_matmul_gated(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                      out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, w, ids = inputs
    return (dispatch_expert_matmul(backend, x, w, ids, gated=True, activation=params.get("activation", "silu")),)


def dispatch_expert_matmul(backend: KernelBackend, x: Tensor, w: Tensor, ids: Tensor, gated: bool = False,
                           activation: str = "silu") -> Tensor:
    """Record y [T, k, N] = x through each pair's expert of w [E, N, K] (gated: w [E, 2N, K]
    = [gate; up] per expert, y = act(gate) * up, gelu_tanh for activation "gelu_tanh")."""
    experts, weight_rows, k = w.shape
    gates = 2 if gated else 1
    n = weight_rows // gates
    tokens, top_k = ids.shape
    y = backend.empty((tokens, top_k, n), "f32")
    pairs = tokens * top_k
    if pairs == 0 or n == 0:
        return y
    cfg = expert_config(backend.caps, pairs, experts, gated)
    texel = backend.caps.access_path == "texel"
    x_vec4 = texel and k % 4 == 0
    bindings = [(w, "f32x4" if w.dtype == "f32" else "u32x4", False), (x, "f32x4" if x_vec4 else "f32", False),
                (y, "f32", True), (ids, "i32", False)]
    side_view = LAYOUTS[w.dtype].side_view
    if side_view:
        bindings.append((w, side_view, False))
    expert_bytes = device_nbytes(w.dtype, weight_rows, k)
    push = ("<11I", (tokens, top_k, experts, n, k, -(-k // 32), row_texels(w.dtype, k),
                     quants_bytes(w.dtype, weight_rows, k) // 4, expert_bytes // 16, expert_bytes // 4,
                     int(len(x.shape) == 3)))
    spec = {0: cfg.workgroup, 1: cfg.rows, 3: cfg.tokens, 4: gates, 5: int(cfg.by_expert), 7: TILE_ROWS}
    if gated and activation == "gelu_tanh":
        spec[10] = 1
    if texel:
        spec[2] = int(x_vec4)
    y_groups = experts if cfg.by_expert else pairs
    if y_groups > MAX_GROUPS_X:
        raise ValueError(f"moe_matmul: {y_groups} workgroup rows exceed the dispatch limit")
    row_sets = -(-n // cfg.rows)  # invocations
    groups = (-(-row_sets // cfg.workgroup), y_groups, 1)
    backend.run_shader(module(backend, "matmul_id", w.dtype), bindings, groups, push, spec)
    return y


def _run_router(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (logits,) = inputs
    tokens, experts = logits.shape
    top_k = params["top_k"]
    ids, weights = backend.empty(out[0].shape, "i32"), backend.empty(out[1].shape, "f32")
    if tokens:
        backend.run_shader(module(backend, "moe", "router"),
                           [(logits, "f32", False), (ids, "i32", True), (weights, "f32", True)],
                           grid_1d(tokens), ("<4I", (tokens, experts, top_k, int(params["normalize"]))),
                           local_size())
    return ids, weights


def _run_sigmoid_router(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                        out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    logits, bias = inputs
    tokens, experts = logits.shape
    ids, weights = backend.empty(out[0].shape, "i32"), backend.empty(out[1].shape, "f32")
    if tokens:
        push = (tokens, experts, params["top_k"], int(params["normalize"]), params["scale"], params["norm_eps"],
                params["groups"], params["top_groups"])
        backend.run_shader(module(backend, "moe", "router_sigmoid"),
                           [(logits, "f32", False), (bias, "f32", False), (ids, "i32", True), (weights, "f32", True)],
                           grid_1d(tokens), ("<4I2f2I", push), local_size())
    return ids, weights


def _run_combine(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                 out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    """moe_combine, or moe_combine_shared with the shared expert's output and gate logit."""
    y, weights, *shared = inputs
    tokens, top_k, n = y.shape
    mixed = backend.empty(out[0].shape, "f32")
    if tokens * n:
        bindings = [(y, "f32", False), (weights, "f32", False), (mixed, "f32", True)]
        bindings += [(t, "f32", False) for t in shared]
        backend.run_shader(module(backend, "moe", "combine_shared" if shared else "combine"), bindings,
                           grid_1d(tokens * n), ("<3I", (tokens, n, top_k)), local_size())
    return (mixed,)


def _per_expert(variant: str):
    """moe_add_bias (variant bias) or moe_scale (scale): y [T, k, N] with each row's expert's own [N]."""
    def run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        y, bias, ids = inputs
        tokens, top_k, n = y.shape
        biased = backend.empty(out[0].shape, "f32")
        if biased.numel:
            backend.run_shader(module(backend, "moe", variant),
                               [(y, "f32", False), (bias, "f32", False), (ids, "i32", False), (biased, "f32", True)],
                               grid_1d(biased.numel), ("<2I", (tokens * top_k, n)), local_size())
        return (biased,)

    return run


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("moe_router", "moe.router", _run_router))
    backend.register_kernel(Kernel("moe_router_sigmoid", "moe.router_sigmoid", _run_sigmoid_router))
    backend.register_kernel(Kernel("moe_matmul", "matmul_id", _run_matmul, supports=_matmul_supports))
    backend.register_kernel(Kernel("moe_matmul_gated", "matmul_id.gated", _run_matmul_gated,
                                   supports=_matmul_supports))
    backend.register_kernel(Kernel("moe_combine", "moe.combine", _run_combine))
    backend.register_kernel(Kernel("moe_combine_shared", "moe.combine_shared", _run_combine))
    backend.register_kernel(Kernel("moe_add_bias", "moe.bias", _per_expert("bias")))
    backend.register_kernel(Kernel("moe_scale", "moe.scale", _per_expert("scale")))
