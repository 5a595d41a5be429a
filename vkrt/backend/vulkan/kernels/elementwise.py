"""add, sigmoid_mul, scale, softcap, relu_squared, silu_and_mul, gelu_tanh_and_mul, clamped_swiglu,
gather_rows, gelu_tanh_mul_slice: shaders/elementwise.comp."""

from __future__ import annotations

from typing import Any

from vkrt.backend.base import Kernel
from vkrt.backend.vulkan.kernels.common import KernelBackend, grid_1d, local_size, module
from vkrt.core.tensor import Tensor, TensorSpec


def _binary(variant: str):
    def run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        a, b = inputs
        y = backend.empty(out[0].shape, "f32")
        backend.run_shader(module(backend, "elementwise", variant),
                           [(a, "f32", False), (b, "f32", False), (y, "f32", True)],
                           grid_1d(a.numel), ("<IIf", (a.numel, b.numel, 0.0)), local_size())
        return (y,)

    return run


def _gated(variant: str):
    def run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        (x,) = inputs
        y = backend.empty(out[0].shape, "f32")
        n = y.numel
        backend.run_shader(module(backend, "elementwise", variant),
                           [(x, "f32", False), (y, "f32", True)],
                           grid_1d(n), ("<IIf", (n, out[0].shape[-1], 0.0)), local_size())
        return (y,)

    return run


def _clamped_swiglu(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                    out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (x,) = inputs
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "elementwise", "clamped_swiglu"), [(x, "f32", False), (y, "f32", True)],
                       grid_1d(y.numel), ("<IIff", (y.numel, out[0].shape[-1], params["limit"], params["alpha"])),
                       local_size())
    return (y,)


def _unary(variant: str, param: str):
    def run(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        (x,) = inputs
        y = backend.empty(out[0].shape, "f32")
        backend.run_shader(module(backend, "elementwise", variant), [(x, "f32", False), (y, "f32", True)],
                           grid_1d(x.numel), ("<IIf", (x.numel, 1, params[param])), local_size())
        return (y,)

    return run


def _relu_squared(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                  out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    (x,) = inputs
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "elementwise", "relu2"), [(x, "f32", False), (y, "f32", True)],
                       grid_1d(x.numel), ("<IIf", (x.numel, 1, 0.0)), local_size())
    return (y,)


def _gather(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
            out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    x, index = inputs
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "elementwise", "gather"),
                       [(x, "f32", False), (index, "i32", False), (y, "f32", True)],
                       grid_1d(y.numel), ("<IIf", (y.numel, x.shape[1], 0.0)), local_size())
    return (y,)


def _gelu_mul_slice(backend: KernelBackend, inputs: tuple[Tensor, ...], params: dict[str, Any],
                    out: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    gate, x = inputs
    y = backend.empty(out[0].shape, "f32")
    backend.run_shader(module(backend, "elementwise", "gelu_mul_slice"),
                       [(gate, "f32", False), (x, "f32", False), (y, "f32", True)], grid_1d(y.numel),
                       ("<IIII", (y.numel, gate.shape[1], params["start"], x.shape[1])), local_size())
    return (y,)


def register(backend: KernelBackend) -> None:
    backend.register_kernel(Kernel("gather_rows", "elementwise.gather", _gather))
    backend.register_kernel(Kernel("gelu_tanh_mul_slice", "elementwise.gelu_mul_slice", _gelu_mul_slice))
    backend.register_kernel(Kernel("add", "elementwise.add", _binary("add")))
    backend.register_kernel(Kernel("sigmoid_mul", "elementwise.sigmoid_mul", _binary("sigmoid_mul")))
    backend.register_kernel(Kernel("scale", "elementwise.scale", _unary("scale", "factor")))
    backend.register_kernel(Kernel("softcap", "elementwise.softcap", _unary("softcap", "cap")))
    backend.register_kernel(Kernel("relu_squared", "elementwise.relu2", _relu_squared))
    backend.register_kernel(Kernel("silu_and_mul", "elementwise.silu_mul", _gated("silu_mul")))
    backend.register_kernel(Kernel("gelu_tanh_and_mul", "elementwise.gelu_mul", _gated("gelu_mul")))
    backend.register_kernel(Kernel("clamped_swiglu", "elementwise.clamped_swiglu", _clamped_swiglu))
