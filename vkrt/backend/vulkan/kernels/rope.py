"""rope (NeoX and interleaved, partial rotary): shaders/rope.comp, one invocation per element."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.core.tensor import Tensor, TensorSpec


def _rope(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
          out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, positions, cos_sin = inputs
    max_positions, rot_dim = cos_sin.shape
    y = backend.empty(out[0].shape, "f32")
    push = (x.numel, x.shape[1], params["head_dim"], rot_dim, max_positions,
            int(params.get("interleaved", False)))
    backend.run_shader(module(backend, "rope"),
                       [(x, "f32", False), (positions, "i32", False), (cos_sin, "f32", False),
                        (y, "f32", True)],
                       grid_1d(x.numel), ("<6I", push), local_size())
    return (y,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("rope", "rope", _rope))
