"""The recurrent mixers' kernels: causal_conv1d and short_conv (shaders/causal_conv1d.comp, an
invocation per (sequence, channel)), gated_delta_net (shaders/gated_delta_net.comp, an invocation
per (sequence, value head, state column)), ssm_scan (shaders/ssm_scan.comp, an invocation per
(sequence, head, state row)), each with a chunked form for prefill, opt-in; copy_state_slots, one
buffer copy of a region per slot (no shader)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vkrt import config
from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.core.tensor import Tensor, TensorSpec
from vkrt.errors import VkrtError


def _conv(form: str):
    def run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        x, w, bias, state, seq_start, positions, state_slots = inputs
        seqs, channels = state_slots.shape[0], w.shape[0]
        y = backend.empty(out[0].shape, "f32")
        spec = local_size() | {1: w.shape[1], 2: int(params.get("activation", "") == "silu")}
        backend.run_shader(module(backend, "causal_conv1d", form),
                           [(x, "f32", False), (w, "f32", False), (bias, "f32", False), (state, "f32", True),
                            (seq_start, "i32", False), (positions, "i32", False), (state_slots, "i32", False),
                            (y, "f32", True)],
                           grid_1d(seqs * channels), ("<2I", (seqs, channels)), spec)
        return (y,)
    return run


MAX_KEY_DIM = 256  # the delta net's state column in registers (gated_delta_net.comp)
# The delta net and the scan read their state slot through a second, read-only binding of the same
# tensor (texel on CPU devices, where a storage-buffer load costs many texel loads) and write it
# through the storage buffer; each invocation reads its own state before it writes it, so the
# two views never race (measured: a Qwen3.5-shaped decode call, 16 value heads of 128 x 128,
# went from ~9 ms to ~5 ms on llvmpipe).


# The chunked forms (gated_delta_net_{norm,prep,chunk}.comp, ssm_scan_{prep,chunk}.comp;
# vkrt/ops/recurrent.py has their math) take the sequences of a step with at least CHUNKED_FROM
# tokens: on a GPU the recurrent walk is one dependent step per token with a few thousand
# invocations per sequence, which leaves most of the device idle. Shorter sequences, decode rows
# among them, stay on the recurrent kernel in the same step, so a sequence's result depends on its
# own tokens only, never on its neighbours (batch invariance), and a decode step is exactly what
# it was.
CHUNKED_FROM = 16
MAX_CHUNK = 64  # the per-row arrays of a chunk's values (gated_delta_net_chunk.comp, ssm_scan_chunk.comp)


def _prefill_form(variable: str, override: str | None) -> str:
    """'chunked' or 'recurrent': recurrent unless the environment variable says chunked. The
    recurrent walk measured faster on llvmpipe (docs/BENCHMARKS.md), and it keeps a prompt's bits
    the same however its prefill is split into steps; the chunked forms are opt-in until they are
    measured faster on a GPU."""
    if override is not None:
        if override not in ("chunked", "recurrent"):
            raise VkrtError(f"{variable} must be 'chunked' or 'recurrent', not {override!r}")
        return override
    return "recurrent"


def delta_net_form(caps: DeviceCaps) -> str:
    """The gated delta rule's prefill kernel on this device (VKRT_DELTA_NET; `caps` is where a
    device's default will be read)."""
    return _prefill_form("VKRT_DELTA_NET", config.delta_net_form())


def mamba2_form(caps: DeviceCaps) -> str:
    """Mamba2's prefill scan on this device (VKRT_MAMBA2; `caps` is where a device's default will
    be read)."""
    return _prefill_form("VKRT_MAMBA2", config.mamba2_form())


def prefill_chunk(caps: DeviceCaps) -> int:
    """Tokens per chunk: 64 on GPUs (transformers' and fla's size), 16 on CPU devices, where the
    chunk pass's per-token intra-chunk sums (2 x chunk for the delta rule) are memory traffic
    against a few state-row loads."""
    return 16 if caps.device_type == "cpu" else MAX_CHUNK


def _by_prefill_form(form: str, tokens: int, seqs: int, chunked: Callable[[], None],
                     recurrent: Callable[[int], None]) -> None:
    """Run the chunked kernels over the sequences of CHUNKED_FROM tokens or more when `form` is
    'chunked', and `recurrent(chunked_from)` over the rest (0: over every sequence)."""
    # a sequence may reach CHUNKED_FROM tokens only if the others leave it that many
    use_chunked = form == "chunked" and tokens - (seqs - 1) >= CHUNKED_FROM
    if use_chunked:
        chunked()
    if not use_chunked or seqs > 1:  # a lone sequence of CHUNKED_FROM tokens or more is the chunked kernels'
        recurrent(CHUNKED_FROM if use_chunked else 0)


def _gated_delta_net(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                     out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    seqs, tokens = inputs[7].shape[0], inputs[0].shape[0]  # state_slots [S], qkv [T, ...]
    o = backend.empty(out[0].shape, "f32")
    _by_prefill_form(delta_net_form(backend.caps), tokens, seqs, lambda: _chunked_delta_net(backend, inputs, params, o),
                     lambda chunked_from: _recurrent_delta_net(backend, inputs, params, o, chunked_from))
    return (o,)


def _recurrent_delta_net(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any], o: Tensor,
                         chunked_from: int) -> None:
    """gated_delta_net.comp over the sequences of fewer than `chunked_from` tokens (0: all)."""
    qkv, ba, a_rate, dt_bias, state, seq_start, positions, state_slots = inputs
    seqs, v_heads, dv = state_slots.shape[0], params["num_v_heads"], params["v_head_dim"]
    push = (seqs, params["num_k_heads"], v_heads, dv, int(params.get("tiled_heads", False)),
            params.get("beta_scale", 1.0), chunked_from)
    backend.run_shader(module(backend, "gated_delta_net"),
                       [(qkv, "f32", False), (ba, "f32", False), (a_rate, "f32", False), (dt_bias, "f32", False),
                        (state, "f32", True), (seq_start, "i32", False), (positions, "i32", False),
                        (state_slots, "i32", False), (o, "f32", True), (state, "f32", False)],
                       grid_1d(seqs * v_heads * dv), ("<5IfI", push), local_size() | {1: params["k_head_dim"]})


def _chunked_delta_net(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                       o: Tensor) -> None:
    """The chunked form over the sequences of at least CHUNKED_FROM tokens, in three passes:
    normalised q and k rows; each token's rows of the chunk's triangular system and attention;
    the walk over chunks carrying the state."""
    qkv, ba, a_rate, dt_bias, state, seq_start, positions, state_slots = inputs
    seqs, tokens = state_slots.shape[0], qkv.shape[0]
    k_heads, v_heads, dk, dv = (params[n] for n in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"))
    tiled = int(params.get("tiled_heads", False))
    chunk = prefill_chunk(backend.caps)
    spec = local_size() | {1: dk, 2: chunk}
    qk = backend.empty((tokens, 2 * k_heads, dk), "f32")
    backend.run_shader(module(backend, "gated_delta_net_norm"), [(qkv, "f32", False), (qk, "f32", True)],
                       grid_1d(tokens * 2 * k_heads), ("<3I", (tokens, k_heads, v_heads * dv)), local_size() | {1: dk})
    amat, qkmat = (backend.empty((tokens, v_heads, chunk), "f32") for _ in range(2))
    gcum, beta = (backend.empty((tokens, v_heads), "f32") for _ in range(2))
    push = (tokens, seqs, k_heads, v_heads, tiled, params.get("beta_scale", 1.0), CHUNKED_FROM)
    backend.run_shader(module(backend, "gated_delta_net_prep"),
                       [(qk, "f32", False), (ba, "f32", False), (a_rate, "f32", False), (dt_bias, "f32", False),
                        (seq_start, "i32", False), (amat, "f32", True), (qkmat, "f32", True), (gcum, "f32", True),
                        (beta, "f32", True)],
                       grid_1d(tokens * v_heads), ("<5IfI", push), spec)
    backend.run_shader(module(backend, "gated_delta_net_chunk"),
                       [(qkv, "f32", False), (qk, "f32", False), (amat, "f32", False), (qkmat, "f32", False),
                        (gcum, "f32", False), (beta, "f32", False), (state, "f32", True), (seq_start, "i32", False),
                        (positions, "i32", False), (state_slots, "i32", False), (o, "f32", True),
                        (state, "f32", False)],
                       grid_1d(seqs * v_heads * dv), ("<6I", (seqs, k_heads, v_heads, dv, tiled, CHUNKED_FROM)), spec)


MAX_STATE_SIZE = 256  # a row of Mamba2's state in registers (ssm_scan.comp)


def _ssm_scan(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
              out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    seqs, tokens = inputs[8].shape[0], inputs[0].shape[0]  # state_slots [S], xbc [T, ...]
    y = backend.empty(out[0].shape, "f32")
    _by_prefill_form(mamba2_form(backend.caps), tokens, seqs, lambda: _chunked_ssm_scan(backend, inputs, params, y),
                     lambda chunked_from: _recurrent_ssm_scan(backend, inputs, params, y, chunked_from))
    return (y,)


def _time_step_limits(params: dict[str, Any]) -> tuple[float, float]:
    """dt_min and dt_max as f32 push constants: an infinite dt_max as the largest float."""
    return params.get("dt_min", 0.0), min(params.get("dt_max", float("inf")), 3.4e38)


def _recurrent_ssm_scan(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any], y: Tensor,
                        chunked_from: int) -> None:
    """ssm_scan.comp over the sequences of fewer than `chunked_from` tokens (0: all)."""
    xbc, dt, a_rate, skip, dt_bias, state, seq_start, positions, state_slots = inputs
    seqs, heads, head_dim = state_slots.shape[0], params["num_heads"], params["head_dim"]
    push = (seqs, heads, head_dim, params["n_groups"], *_time_step_limits(params), chunked_from)
    backend.run_shader(module(backend, "ssm_scan"),
                       [(xbc, "f32", False), (dt, "f32", False), (a_rate, "f32", False), (skip, "f32", False),
                        (dt_bias, "f32", False), (state, "f32", True), (seq_start, "i32", False),
                        (positions, "i32", False), (state_slots, "i32", False), (y, "f32", True),
                        (state, "f32", False)],
                       grid_1d(seqs * heads * head_dim), ("<4I2fI", push), local_size() | {1: params["state_size"]})


def _chunked_ssm_scan(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any], y: Tensor) -> None:
    """The chunked (SSD) form over the sequences of at least CHUNKED_FROM tokens, in two passes:
    each token's row of the chunk's decayed C . B weights; the walk over chunks carrying the state."""
    xbc, dt, a_rate, skip, dt_bias, state, seq_start, positions, state_slots = inputs
    seqs, tokens = state_slots.shape[0], xbc.shape[0]
    heads, head_dim, groups = params["num_heads"], params["head_dim"], params["n_groups"]
    chunk = prefill_chunk(backend.caps)
    spec = local_size() | {1: params["state_size"], 2: chunk}
    weights = backend.empty((tokens, heads, chunk), "f32")
    lcum, steps = (backend.empty((tokens, heads), "f32") for _ in range(2))
    push = (tokens, seqs, heads, head_dim, groups, *_time_step_limits(params), CHUNKED_FROM)
    backend.run_shader(module(backend, "ssm_scan_prep"),
                       [(xbc, "f32", False), (dt, "f32", False), (a_rate, "f32", False), (dt_bias, "f32", False),
                        (seq_start, "i32", False), (weights, "f32", True), (lcum, "f32", True), (steps, "f32", True)],
                       grid_1d(tokens * heads), ("<5I2fI", push), spec)
    backend.run_shader(module(backend, "ssm_scan_chunk"),
                       [(xbc, "f32", False), (skip, "f32", False), (weights, "f32", False), (lcum, "f32", False),
                        (steps, "f32", False), (state, "f32", True), (seq_start, "i32", False),
                        (positions, "i32", False), (state_slots, "i32", False), (y, "f32", True),
                        (state, "f32", False)],
                       grid_1d(seqs * heads * head_dim), ("<5I", (seqs, heads, head_dim, groups, CHUNKED_FROM)), spec)


def _copy_state_slots(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                      out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (state,) = inputs
    size = state.nbytes // state.shape[0]  # one slot's bytes ([slots, ...] is contiguous f32)
    backend.copy_regions(state, state, [(s * size, d * size, size) for s, d in zip(params["src"], params["dst"],
                                                                                  strict=True)])
    return ()


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("causal_conv1d", "causal_conv1d.plain", _conv("plain")))
    backend.register_kernel(Kernel("short_conv", "causal_conv1d.gated", _conv("gated")))
    backend.register_kernel(Kernel("gated_delta_net", "gated_delta_net", _gated_delta_net,
                                   supports=lambda inputs, params: params["k_head_dim"] <= MAX_KEY_DIM))
    backend.register_kernel(Kernel("ssm_scan", "ssm_scan", _ssm_scan,
                                   supports=lambda inputs, params: params["state_size"] <= MAX_STATE_SIZE))
    backend.register_kernel(Kernel("copy_state_slots", "copy_state_slots.buffer_copy", _copy_state_slots))
