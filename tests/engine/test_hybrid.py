"""Hybrid models in the engine: the recurrent state is per sequence, in a slot of the state pool.

tiny_lfm2 (three gated short-convolution layers, one attention layer) and tiny_qwen3_5 (three
gated delta nets, one gated attention layer) through LLM on Vulkan:
concurrent requests equal sequential ones (ids and logprobs), chunked prefill equals one
prefill, preemption recomputes the state and aborts return it, every path leaves the pool full,
all with prefix caching on (its state snapshots: test_hybrid_prefix.py); without snapshot memory
prefix caching is off (a repeated prompt is recomputed, never served a state it lacks).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.conftest import FIXTURES
from vkrt.engine import LLM, SamplingParams
from vkrt.engine.speculative import SpeculativeConfig

# bit-exact across splits of a prompt into steps: the recurrent delta-net and Mamba2 kernels (conftest.py)
pytestmark = pytest.mark.usefixtures("recurrent_prefill")

MAX_LEN = 64
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", params=["tiny_lfm2", "tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_granite4", "tiny_qwen3_next", "tiny_nemotron_h", "tiny_lfm2_moe", "tiny_olmo_hybrid", "tiny_granite4_moe", "tiny_nemotron_h_moe", "tiny_falcon_h1"])
def fixture(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def cases(fixture: str) -> list[dict]:
    return json.loads((FIXTURES / fixture / "golden.json").read_text())["cases"]


def prompts(fixture: str) -> list[list[int]]:
    return [c["input_ids"] for c in cases(fixture)]


def make_llm(fixture: str, **overrides: Any) -> LLM:
    config: dict[str, Any] = dict(device="vulkan", max_model_len=MAX_LEN, max_num_seqs=4, kv_dtype="f32")
    return LLM(FIXTURES / fixture, **{**config, **overrides})


def ids_and_logprobs(outputs: list) -> list[tuple[list[int], list[float]]]:
    return [(o.token_ids, [lp.token.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


def assert_pool_full(llm: LLM) -> None:
    states = llm.engine.block_manager.states
    assert states is not None and states.num_free == states.num_slots == 4


@pytest.fixture(scope="module")
def alone(fixture: str) -> list[tuple[list[int], list[float]]]:
    """Each prompt run by itself: the reference the other runs must equal exactly."""
    llm = make_llm(fixture, max_num_seqs=1)
    return [ids_and_logprobs(llm.generate([p], GREEDY))[0] for p in prompts(fixture)]


def test_greedy_ids_match_transformers(fixture: str, alone: list[tuple[list[int], list[float]]]) -> None:
    assert [ids for ids, _ in alone] == [c["greedy_ids"] for c in cases(fixture)]


def test_concurrent_requests_equal_sequential_ones(fixture: str, alone: list[tuple[list[int], list[float]]]) -> None:
    llm = make_llm(fixture)
    got = ids_and_logprobs(llm.generate(prompts(fixture), GREEDY))
    assert got == alone  # ids and logprobs, bit for bit: each sequence's state is its own
    assert_pool_full(llm)
    assert llm.engine.totals.decode_counters_max.get("drains", 0) == 0


def test_chunked_prefill_equals_one_prefill(fixture: str, alone: list[tuple[list[int], list[float]]]) -> None:
    llm = make_llm(fixture, max_num_batched_tokens=7)  # the 40-token prompt is prefilled in chunks of <= 7
    assert ids_and_logprobs(llm.generate(prompts(fixture), GREEDY)) == alone
    assert_pool_full(llm)


# the environment variable that forces each chunked prefill form, and the fixtures that have its mixer
CHUNKED_FORMS = {"VKRT_DELTA_NET": ("tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_qwen3_next", "tiny_olmo_hybrid"),
                 "VKRT_MAMBA2": ("tiny_granite4", "tiny_nemotron_h", "tiny_granite4_moe", "tiny_nemotron_h_moe",
                                 "tiny_falcon_h1")}
CHUNKED_LOGPROB_TOLERANCE = 1e-4


def test_chunked_prefill_matches_recurrent(fixture: str, alone: list[tuple[list[int], list[float]]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked prefill form of the fixture's mixer (the delta rule's or Mamba2's, forced here)
    gives transformers' greedy ids, and the recurrent run's logprobs within a tolerance (the same
    sums regrouped by chunk, so not the same bits)."""
    forms = [name for name, fixtures in CHUNKED_FORMS.items() if fixture in fixtures]
    if not forms:
        pytest.skip("no mixer with a chunked prefill form (gated delta net, Mamba2)")
    monkeypatch.setenv(forms[0], "chunked")
    got = ids_and_logprobs(make_llm(fixture, max_num_seqs=1).generate(prompts(fixture), GREEDY))
    assert [ids for ids, _ in got] == [c["greedy_ids"] for c in cases(fixture)]
    diffs = [abs(a - b) for (_, lps), (_, want) in zip(got, alone, strict=True) for a, b in zip(lps, want, strict=True)]
    assert 0 < max(diffs) <= CHUNKED_LOGPROB_TOLERANCE  # 0 would mean the chunked kernels never ran


def test_preemption_recomputes_the_state(fixture: str, alone: list[tuple[list[int], list[float]]]) -> None:
    llm = make_llm(fixture, num_kv_blocks=8, max_num_batched_tokens=64)  # 8 blocks of 16: four requests cannot all fit
    assert ids_and_logprobs(llm.generate(prompts(fixture), GREEDY)) == alone
    assert llm.engine.num_preemptions > 0
    assert_pool_full(llm)


def test_aborts_return_the_slots(fixture: str) -> None:
    llm = make_llm(fixture)
    engine = llm.engine
    for i, prompt in enumerate(prompts(fixture)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    states = engine.block_manager.states
    assert states is not None and states.num_free == 0  # four running, four slots held
    for i in range(len(prompts(fixture))):
        engine.abort(str(i))
    assert_pool_full(llm)


def test_without_snapshot_memory_prefix_caching_is_off(fixture: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="vkrt.engine.engine"):
        llm = make_llm(fixture, state_snapshot_memory=0)
    assert "prefix caching is off for this model: --state-snapshot-memory" in caplog.text
    assert llm.engine.prefix_caching is False and llm.engine.block_manager.snapshots is None
    first, again = (llm.generate([prompts(fixture)[-1]], GREEDY)[0] for _ in range(2))
    assert again.num_cached_tokens == 0
    assert again.token_ids == first.token_ids
    np.testing.assert_array_equal([lp.token.logprob for lp in again.outputs[0].logprobs],
                                  [lp.token.logprob for lp in first.outputs[0].logprobs])


def test_state_memory_caps_the_sequences_that_run_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Slots come out of --state-memory: fewer than max_num_seqs fit -> capped, with a warning
    naming the per-sequence state; not one fits -> a one-line error, before anything is allocated."""
    from vkrt.errors import VkrtError

    slot = make_llm("tiny_lfm2", max_num_seqs=1).engine.model.state_bytes_per_slot()
    assert slot > 0
    with caplog.at_level("WARNING", logger="vkrt.engine.engine"):
        llm = make_llm("tiny_lfm2", state_memory=3 * slot + slot // 2)
    assert llm.engine.config.max_num_seqs == 3 and llm.engine.block_manager.states.num_slots == 3
    assert "max_num_seqs capped at 3 (asked 4)" in caplog.text
    outs = llm.generate(prompts("tiny_lfm2") * 3, GREEDY)  # more requests than slots still all finish
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    with pytest.raises(VkrtError, match="recurrent state is .* MiB but the state memory is .*--state-memory"):
        make_llm("tiny_lfm2", state_memory=slot - 1)
    # speculating, each sequence holds a checkpoint slot too: half as many fit
    caplog.clear()
    with caplog.at_level("WARNING", logger="vkrt.engine.engine"):
        spec = make_llm("tiny_lfm2", state_memory=3 * slot + slot // 2,
                        speculative=SpeculativeConfig("ngram", 3, 4, 2))
    assert spec.engine.config.max_num_seqs == 1 and "with its checkpoint for speculation" in caplog.text
