"""Every golden fixture and the default model on every Vulkan memory path.

Fixtures are discovered: each tests/fixtures/*/golden.json beside an HF directory's
config.json, or naming its model file in `meta.model_file`, so a new family's fixture is picked up with no edit here, and
one whose architecture vkrt cannot build fails. Each runs on both access paths (texel,
storage buffer) in this process; `test_every_golden_on_the_staging_path` runs this module's
storage-buffer tests again in a child process with VKRT_FORCE_STAGING=1 (the memory path
is chosen per process, with its one device): what a discrete GPU runs.

Per fixture and path: the prefill logits of every case against transformers' `all_logits`;
the same positions decoded one token at a time through the KV cache against the same rows;
greedy ids (a divergence allowed only at a recorded margin under twice the bound).
Bound: max |logit - golden| <= 1e-4 (measured <= 1.6e-5 on every path: the goldens are
rounded to 6 significant digits, ~5e-6 of it).

SmolLM2 (Q4_1): first_step_top5 ids equal and logits within 5e-4 of transformers' f32
forward on both paths (measured <= 6.1e-5 on the texel path: the goldens' 6-digit rounding of logits ~20),
and the engine's 24-token greedy decode of every golden prompt on the storage-buffer path equal to the
texel path's token for token: tests/models/test_llama_golden.py walks the texel path against transformers'
greedy ids, and tests/engine/test_token_exact.py ties it to the reference backend. (A one-token-at-a-time
walk on the storage-buffer path, ~70 s here, checked nothing these do not.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import FIXTURES, GOLDEN_LOGIT_ATOL_FOR
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.loader import load_model
from vkrt.models import CausalLM, build_model

REPO = Path(__file__).resolve().parents[2]


def _is_model_golden(golden_json: Path) -> bool:
    """A model's golden: an HF directory (config.json) or a model file its meta names."""
    meta = json.loads(golden_json.read_text()).get("meta", {})
    return (golden_json.parent / "config.json").is_file() or "model_file" in meta


GOLDENS = sorted(p.parent.name for p in FIXTURES.glob("*/golden.json") if _is_model_golden(p))
PATHS = ("texel", "ssbo")
LOGIT_ATOL = 1e-4
TOP5_ATOL = 5e-4
MAX_LEN = 64
EXACT_TOKENS = 24
STAGING_PROMPT_TOKENS = 8  # the staging child's SmolLM2 prompts: the short ones (4-6 tokens)


def golden(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "golden.json").read_text())


def model_path(name: str) -> Path:
    """The fixture's HF directory, or the model file its golden names (`meta.model_file`)."""
    return FIXTURES / name / golden(name).get("meta", {}).get("model_file", "")


@pytest.fixture(scope="module", params=PATHS)
def path_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The Vulkan backend on one access path, for the whole module."""
    from tests.conftest import _vulkan_or_skip

    backend = _vulkan_or_skip()
    previous = backend.caps.access_path  # type: ignore[attr-defined]
    backend.set_access_path(request.param)  # type: ignore[attr-defined]
    yield backend
    backend.set_access_path(previous)  # type: ignore[attr-defined]


_MODELS: dict[tuple[str, str], CausalLM] = {}


def model_on_path(path_backend: Backend, path: Path) -> CausalLM:
    """The model at `path`, built once per access path (an unsupported architecture raises)."""
    key = (str(path), path_backend.caps.access_path)  # type: ignore[attr-defined]
    if key not in _MODELS:
        _MODELS[key] = build_model(load_model(path), path_backend)
    return _MODELS[key]


def model_on(path_backend: Backend, name: str) -> CausalLM:
    return model_on_path(path_backend, model_path(name))


def test_fixtures_are_discovered() -> None:
    assert {"tiny_llama", "tiny_llama_tied", "tiny_llama_bf16"} <= set(GOLDENS)
    for name in GOLDENS:
        assert model_path(name).exists(), f"{name}: golden.json names a model that is not there"


def _within(got: np.ndarray, want: np.ndarray, name: str, label: str) -> None:
    assert got.shape == want.shape, label
    diff = float(np.abs(got - want).max())
    bound = GOLDEN_LOGIT_ATOL_FOR.get(name, LOGIT_ATOL)
    assert diff <= bound, f"{label}: max |logit - golden| {diff:.3g} > {bound}"


@pytest.mark.parametrize("name", GOLDENS)
def test_prefill_logits(path_backend: Backend, name: str) -> None:
    model = model_on(path_backend, name)
    for case in golden(name)["cases"]:
        logits = Greedy(model, MAX_LEN).step(case["input_ids"], 0, all_logits=True)
        _within(logits, np.array(case["all_logits"], np.float32), name, f"{name} prefill len {len(case['input_ids'])}")


@pytest.mark.parametrize("name", GOLDENS)
def test_decode_logits_per_step(path_backend: Backend, name: str) -> None:
    """Each prompt fed one token per step through the KV cache: step i's logits equal row i
    of the golden's full-prompt logits."""
    model = model_on(path_backend, name)
    for case in golden(name)["cases"]:
        driver, want = Greedy(model, MAX_LEN), np.array(case["all_logits"], np.float32)
        for i, token in enumerate(case["input_ids"]):
            _within(driver.step([token], i)[-1], want[i], name, f"{name} decode step {i}")


def _margin_match(got: list[int], want: list[int], margins: list[float], tolerance: float) -> int:
    """Leading ids equal; a divergence only at a recorded near-tie. Returns the ids compared."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            assert margins[i] < tolerance, f"diverged at step {i} (margin {margins[i]:.3g}): {got} vs {want}"
            return i
    return min(len(got), len(want))


@pytest.mark.parametrize("name", GOLDENS)
def test_greedy_ids(path_backend: Backend, name: str) -> None:
    model = model_on(path_backend, name)
    for case in golden(name)["cases"]:
        want = case["greedy_ids"]
        got = Greedy(model, MAX_LEN).generate(case["input_ids"], len(want))
        _margin_match(got, want, case["greedy_margins"], 2 * LOGIT_ATOL)


# ------------------------------------------------------------------------------ SmolLM2

def _smol_cases() -> list[dict[str, Any]]:
    data = json.loads((FIXTURES / "smollm2_golden.json").read_text())
    return [*data["text_prompts"], *data["chats"]]


def test_smollm2_first_step(path_backend: Backend, smollm2_path: Path) -> None:
    """Every prompt's first step (in the staging child, the short prompts' only): top-5 ids equal
    transformers', their logits within TOP5_ATOL."""
    model = model_on_path(path_backend, smollm2_path)
    cases = _smol_cases()
    if os.environ.get("VKRT_FORCE_STAGING") == "1":
        # The staging child: the weights have crossed the staging copies once any prompt has run
        # through every layer; the short prompts do that, the 40-64-token ones (~3 s each on this
        # path under llvmpipe) add nothing the parent's run of them did not check.
        cases = [case for case in cases if len(case["prompt_ids"]) <= STAGING_PROMPT_TOKENS]
        assert cases, f"no golden prompt of at most {STAGING_PROMPT_TOKENS} tokens for the staging child"
    for case in cases:
        logits = Greedy(model, len(case["prompt_ids"]) + 1).step(case["prompt_ids"], 0)[-1]
        _top5_within(logits, case)


def _top5_within(logits: np.ndarray, case: dict[str, Any]) -> None:
    label = repr(case.get("prompt", case.get("messages")))[:40]
    top5 = case["first_step_top5"]
    order = np.argsort(-logits, kind="stable")[:5]
    assert order.tolist() == top5["ids"], f"{label}: top-5 {order.tolist()} vs {top5['ids']}"
    diff = float(np.abs(logits[top5["ids"]] - np.array(top5["logits"])).max())
    assert diff <= TOP5_ATOL, f"{label}: first-step top-5 logits differ by {diff:.3g}"


def test_smollm2_token_exact_across_paths(vk_default: Backend, smollm2_path: Path) -> None:
    """The engine's greedy decode (replayed steps) of every golden prompt, batched, is the same on
    both access paths."""
    from vkrt.engine import LLM, SamplingParams

    caps: Any = vk_default.caps  # type: ignore[attr-defined]
    previous, ids = caps.access_path, {}
    params = SamplingParams(max_tokens=EXACT_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        for path in PATHS:
            vk_default.set_access_path(path)  # type: ignore[attr-defined]
            llm = LLM(smollm2_path, device="vulkan", max_model_len=256, max_num_seqs=8)
            ids[path] = [o.token_ids for o in llm.generate([c["prompt_ids"] for c in _smol_cases()], params)]
            assert llm.stats()["decode_counters_max"]["drains"] == 0
    finally:
        vk_default.set_access_path(previous)  # type: ignore[attr-defined]
    assert all(len(seq) == EXACT_TOKENS for seq in ids["texel"])
    assert ids["ssbo"] == ids["texel"]


# ------------------------------------------------------------------------------ staging

def test_memory_path_is_the_one_asked_for(vk_default: Backend) -> None:
    """With VKRT_FORCE_STAGING=1 tensors live in device-local memory behind staging copies."""
    memory: Any = vk_default.memory  # type: ignore[attr-defined]
    forced = os.environ.get("VKRT_FORCE_STAGING") == "1"
    assert memory.unified == (vk_default.caps.unified_memory and not forced)  # type: ignore[attr-defined]


def test_every_golden_on_the_staging_path(vk_default: Backend) -> None:
    if os.environ.get("VKRT_FORCE_STAGING") == "1":
        pytest.skip("this process is the staging run")  # the child below: nothing to nest
    env = {**os.environ, "VKRT_FORCE_STAGING": "1"}
    # Staging with storage buffers, what a discrete GPU runs (the access path is orthogonal
    # to where memory lives; texel x staging adds time, not coverage of a real device). Every
    # fixture's weights and a prefill through its KV cache cross the staging copies; the
    # one-token decode and greedy walks read the same memory through the same kernels, so
    # SmolLM2's weights cross them in the first steps of its short prompts only (its engine decode
    # is ~40 s on this path).
    select = "(prefill_logits or smollm2_first_step) and not texel"
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select,
                            str(Path(__file__).relative_to(REPO))], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=1800)
    tail = child.stdout[-4000:] + child.stderr[-2000:]
    assert child.returncode == 0, tail
    assert " passed" in child.stdout and "skipped" not in child.stdout and "failed" not in child.stdout, tail
