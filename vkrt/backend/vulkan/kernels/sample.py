"""sample_top_k (token sampling): shaders/sample.comp, one row per workgroup."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.device import DeviceCaps
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, module
from vkrt.backend.vulkan.kernels.norm import row_workgroup
from vkrt.core.tensor import Tensor, TensorSpec
from vkrt.ops.sampling import MAX_TOP_K

CHUNK = 32  # the shader's CHUNK: columns per lane noted between list insertions


def shared_bytes(lanes: int) -> int:
    """The shader's shared memory for `lanes` lanes: per-lane lists and notes, candidates."""
    return 4 * (2 * MAX_TOP_K * lanes + CHUNK * lanes + 2 * MAX_TOP_K + 2 * lanes)


# llvmpipe ends every loop of an invocation once the invocation's loops have made 65535
# back-edges in all (LP_MAX_TGSI_LOOP_ITERATIONS, shared by all loops of a shader), with no
# error. A lane here loops over n / W columns twice plus its list insertions, so a row
# with fewer than 8 lanes (a CPU with 1- or 4-lane subgroups) ran out at vocab >= 4096 and
# drew from a truncated candidate list (docs/TESTING.md). 8 lanes keep a 152k-token vocab
# under the limit; the shader needs no subgroup of that size, only barriers. A CPU device
# doubles the lanes until a lane's column loops fit LOOP_BUDGET back-edges (Gemma 3's 262k
# vocab takes 16), leaving room below the limit for the list insertions.
MIN_LANES = 8
LOOP_BUDGET = 40000


def sample_workgroup(caps: DeviceCaps, vocab: int = 0) -> int:
    """The row workgroup (spec constant 0): the row kernels' lanes but at least MIN_LANES
    (on a CPU device, more for a vocab too large for llvmpipe's loop limit), halved until
    the per-lane lists fit in shared memory (a 256-lane GPU row would need 165 KiB; 16 lanes
    fit the Vulkan minimum of 16 KiB). The ids do not depend on it."""
    lanes = max(MIN_LANES, row_workgroup(caps))
    if caps.device_type == "cpu":
        while 2 * -(-vocab // lanes) > LOOP_BUDGET and shared_bytes(2 * lanes) <= caps.max_shared_memory:
            lanes *= 2
    while lanes > 1 and shared_bytes(lanes) > caps.max_shared_memory:
        lanes //= 2
    return lanes


def _sample_top_k(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                  out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    logits, sample_params, uniforms, mask = inputs
    rows, n = logits.shape
    ids = backend.empty(out[0].shape, "i32")
    backend.run_shader(module(backend, "sample"),
                       [(logits, "f32", False), (sample_params, "f32x4", False), (uniforms, "f32", False),
                        (mask, "u32", False), (ids, "i32", True)],
                       grid_1d(rows, 1), ("<II", (rows, n)), {0: sample_workgroup(backend.caps, n)})
    return (ids,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("sample_top_k", "sample_top_k", _sample_top_k))
