"""`{"method": "mtp"}` speculation (vkrt/engine/mtp_draft.py) on the MTP fixtures: tiny_qwen3_5's,
tiny_qwen3_next's, tiny_glm4_moe's and tiny_deepseek_v3's checkpoints with a random MTP head of
their family's form (tools/make_mtp_fixture.py).

The head's weights are random, so its guesses are nearly always wrong. Two things are checked
apart: with the head's own proposals the ids are the target's (transformers' greedy ids of the
base fixture, whose weights these are), and with an oracle's proposals in their place (every
third one wrong, so steps accept several tokens) the head's guesses at every step still equal
the head run from scratch over the whole sequence, so its cache catches up correctly after
acceptance and rejection alike.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.models.test_mtp import mtp_fixture_path
from tests.server.live_model import test_device as device_for_tests
from vkrt.backend import get_backend
from vkrt.engine import LLM
from vkrt.engine.config import SamplingParams
from vkrt.engine.mtp_draft import MTPProposer
from vkrt.engine.request import Request
from vkrt.engine.speculative import SpeculativeConfig
from vkrt.errors import VkrtError
from vkrt.loader import load_model
from vkrt.models import ForwardBatch, StepTensors, build_model
from vkrt.models.decoder import DecoderModel
from vkrt.models.mtp import MTPHead, mtp_head_model

MTP = SpeculativeConfig("mtp", 3)
# fixture -> the base fixture whose checkpoint (and transformers golden) it extends
FIXTURE_BASE = {"tiny_qwen3_5_mtp": "tiny_qwen3_5", "tiny_qwen3_next_mtp": "tiny_qwen3_next",
                "tiny_glm4_moe_mtp": "tiny_glm4_moe", "tiny_deepseek_v3_mtp": "tiny_deepseek_v3",
                "tiny_qwen3_5_mtp_gguf": "tiny_qwen3_5", "tiny_glm4_moe_mtp_gguf": "tiny_glm4_moe"}


def _cases(fixture: str) -> list[dict]:
    return json.loads((FIXTURES / FIXTURE_BASE[fixture] / "golden.json").read_text())["cases"]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("fixture", list(FIXTURE_BASE))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mtp_speculation_keeps_transformers_greedy_ids(fixture: str, prefix_caching: bool) -> None:
    """Every golden prompt at once, and each again behind it (a prefix-cache hit when caching
    is on: positions the head never saw the target's states for); the head proposes every step."""
    cases = _cases(fixture)
    llm = LLM(mtp_fixture_path(fixture), device=device_for_tests(), kv_dtype="f32", block_size=4, max_model_len=64,
              speculative=MTP, enable_prefix_caching=prefix_caching)
    n = len(cases[0]["greedy_ids"])
    prompts = [c["input_ids"] for c in cases]
    outs = llm.generate(prompts + prompts, _greedy(n))
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in cases] * 2
    spec = llm.engine.totals.spec
    assert spec.num_drafts > 0 and len(spec.accepted_per_pos) == MTP.num_speculative_tokens, spec  # chains of 3
    proposer = llm.engine.drafter
    assert isinstance(proposer, MTPProposer) and not proposer.views  # finished requests give their blocks back
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


class _Scratch:
    """The head's guesses computed from nothing: the target over the sequence, its final-norm
    states into the head over every position, then the chain (tests/models/test_mtp.py's steps)."""

    def __init__(self, fixture: str) -> None:
        loaded = load_model(mtp_fixture_path(fixture))
        self.backend = get_backend(device_for_tests())
        target = build_model(loaded, self.backend)
        assert isinstance(target, DecoderModel)
        self.target = target
        self.head = MTPHead(target, mtp_head_model(loaded))

    def _step(self, model: DecoderModel, kv: Any, tokens: list[int], start: int) -> StepTensors:
        n = len(tokens)
        pos = np.arange(start, start + n, dtype=np.int32)
        table = np.arange(16, dtype=np.int32)[None, :]
        slots = (table[0][pos // 4] * 4 + pos % 4).astype(np.int32)
        return StepTensors.upload(self.backend, ForwardBatch(np.array(tokens, np.int32), pos, np.zeros(n, np.int32),
                                                             slots, table, np.array([n - 1], np.int32)))

    def guesses(self, tokens: list[int], k: int) -> list[int]:
        """k guesses after `tokens` (the last one not yet run by the target)."""
        target_kv, head_kv = (m.allocate_kv_cache(16, 4, "f32") for m in (self.target, self.head))
        e = len(tokens) - 1
        index = self.backend.upload(np.arange(e, dtype=np.int32), "i32", purpose="inputs")
        _, normed = self.target.forward_pooled(self._step(self.target, target_kv, tokens[:e], 0), target_kv, index)
        hidden = normed.numpy().reshape(e, -1)
        logits, out = self.head.forward_mtp(self._step(self.head, head_kv, tokens[1:], 0), head_kv,
                                            self.backend.upload(hidden, "f32", purpose="inputs"))
        guesses = []
        for j in range(k):
            guesses.append(int(logits.numpy().reshape(-1).argmax()))
            if j + 1 < k:
                state = out.numpy().reshape(-1, hidden.shape[1])[-1:]
                logits, out = self.head.forward_mtp(self._step(self.head, head_kv, [guesses[-1]], e + j), head_kv,
                                                    self.backend.upload(state, "f32", purpose="inputs"))
        return guesses


@pytest.mark.parametrize("fixture", list(FIXTURE_BASE))
def test_mtp_guesses_equal_the_head_from_scratch_across_acceptance(fixture: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The head guesses as usual, then an oracle's proposals (transformers' continuation, every
    third one wrong) replace its guesses, so verify steps accept 0-3 tokens and the head catches
    up on 1-4 positions at a time. Its guesses at every step equal the from-scratch head's (on
    Vulkan its steps replayed, but for each prompt's first catch-up, from position 0), and the
    ids stay transformers'."""
    cases = _cases(fixture)
    truth = {tuple(c["input_ids"]): c["greedy_ids"] for c in cases}
    seen: list[tuple[list[int], list[int]]] = []
    real_propose = MTPProposer.propose
    replayed = _count_head_steps(monkeypatch)

    def propose(self: MTPProposer, wanted: list[tuple[Request, int]]) -> Any:
        cost = real_propose(self, wanted)
        for request, k in wanted:
            if request.spec_token_ids:
                seen.append((list(request.all_token_ids), list(request.spec_token_ids)))
            prompt = tuple(request.prompt_token_ids)
            done = request.num_output_tokens
            rest = truth[prompt][done:done + k]
            request.spec_token_ids = [t if (done + i) % 3 else (t + 1) % 8 for i, t in enumerate(rest)]
        return cost

    monkeypatch.setattr(MTPProposer, "propose", propose)
    llm = LLM(mtp_fixture_path(fixture), device=device_for_tests(), kv_dtype="f32", block_size=4, max_model_len=64,
              speculative=MTP, enable_prefix_caching=False)
    n = len(cases[0]["greedy_ids"])
    outs = llm.generate([c["input_ids"] for c in cases], _greedy(n))
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in cases]
    spec = llm.engine.totals.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec
    scratch = _Scratch(fixture)
    assert len(seen) > 10
    for tokens, guesses in seen:
        assert guesses == scratch.guesses(tokens, len(guesses)), f"after {len(tokens)} tokens"
    if device_for_tests() == "vulkan":  # the prompts' catch-ups (from position 0) eager, the rest replayed
        assert replayed["replayed_catch_ups"] > 0 and replayed["eager"] > 0, replayed


def _count_head_steps(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the MTP head's steps run from a recording and run eagerly, and the replayed
    steps' submits, as they happen."""
    from vkrt.engine import mtp_draft

    counts = {"replayed": 0, "replayed_catch_ups": 0, "eager": 0, "replay_submits": 0}
    run, eager = mtp_draft._HeadGraph.run, MTPProposer._run_eagerly

    def counted_run(self: Any, batch: Any, *args: Any) -> Any:
        counts["replayed"] += 1
        counts["replayed_catch_ups"] += batch.num_tokens > batch.num_seqs  # several positions of a view
        before = self.backend.counters.snapshot()
        out = run(self, batch, *args)
        counts["replay_submits"] += self.backend.counters.since(before)["submits"]
        return out

    def counted_eager(self: Any, *args: Any) -> Any:
        counts["eager"] += 1
        return eager(self, *args)

    monkeypatch.setattr(mtp_draft._HeadGraph, "run", counted_run)
    monkeypatch.setattr(MTPProposer, "_run_eagerly", counted_eager)
    return counts


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5_mtp", "tiny_deepseek_v3_mtp"])
def test_replayed_head_steps_propose_what_eager_ones_do(fixture: str, vk_default: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same prompts with the head's steps replayed where they can be and with every step
    eager: the same proposals at every step (both forms: DeepSeek's zeroes position 0's
    embedding, whose steps stay eager), one submit per replayed step, and the same ids."""
    cases = _cases(fixture)
    proposals: dict[bool, list[list[int]]] = {True: [], False: []}
    counts = _count_head_steps(monkeypatch)
    real_propose = MTPProposer.propose
    replay = [True]

    def propose(self: MTPProposer, wanted: list[tuple[Request, int]]) -> Any:
        self.replay = self.replay and replay[0]
        cost = real_propose(self, wanted)
        proposals[replay[0]].extend(list(request.spec_token_ids) for request, _ in wanted)
        return cost

    monkeypatch.setattr(MTPProposer, "propose", propose)
    outs = {}
    for replay[0] in (True, False):
        llm = LLM(mtp_fixture_path(fixture), device="vulkan", kv_dtype="f32", block_size=4, max_model_len=64,
                  speculative=MTP, enable_prefix_caching=False)
        before = dict(counts)
        outs[replay[0]] = [o.outputs[0].token_ids for o in llm.generate([c["input_ids"] for c in cases],
                                                                        _greedy(len(cases[0]["greedy_ids"])))]
        if replay[0]:  # one submit per replayed step (its inputs' writes ride along)
            assert counts["replayed"] > before["replayed"], counts
            assert counts["replay_submits"] == counts["replayed"], counts
        else:
            assert counts["replayed"] == before["replayed"]
        del llm
    assert proposals[True] == proposals[False] and any(proposals[True])
    assert outs[True] == outs[False] == [c["greedy_ids"] for c in cases]


def test_a_model_without_an_mtp_head_is_refused_clearly() -> None:
    with pytest.raises(VkrtError, match='method "mtp" .* has none that vkrt loads'):
        LLM(FIXTURES / "tiny_qwen3_5", device="reference", max_model_len=64, speculative=MTP)


def test_a_replayed_step_brings_back_the_same_states_as_an_eager_one(vk_default: Any) -> None:
    """ModelRunner's token_hidden: a recorded decode step (forward_pooled over the bucket's rows)
    returns every row's final-norm state bit for bit as the eager step does, beside the same ids."""
    from tests.models.test_mixed_step_invariance import BLOCK, batch
    from vkrt.engine.runner import ModelRunner
    from vkrt.engine.sampler import GREEDY_PARAMS, SampleInputs

    model = build_model(load_model(FIXTURES / "tiny_llama"), vk_default)
    prompts = [[(7 * i + s) % 256 for i in range(9)] for s in range(3)]
    tables = [np.array([5, 2]), np.array([0, 3]), np.array([4, 1])]  # blocks in no order
    results = []
    for replay in (True, False):
        kv = model.allocate_kv_cache(6, BLOCK, "f32")
        runner = ModelRunner(model, kv, max_step_tokens=4, max_model_len=2 * BLOCK, replay=replay, token_hidden=True)
        prefill = runner.execute(batch(1, [(p, 0, t) for p, t in zip(prompts, tables, strict=True)]))
        assert prefill.token_hidden is not None and prefill.token_hidden.shape == (27, model.config.hidden_size)
        tokens = [int(r.argmax()) for r in prefill.logits]  # type: ignore[union-attr]
        greedy = SampleInputs(np.tile(GREEDY_PARAMS, (3, 1)), np.zeros(3, np.float32))
        step = runner.execute(batch(1, [([tok], 9, t) for tok, t in zip(tokens, tables, strict=True)]), greedy)
        assert runner.last_step.replayed is replay
        results.append(step)
    replayed, eager = results
    np.testing.assert_array_equal(replayed.token_ids, eager.token_ids)
    assert replayed.token_hidden is not None and eager.token_hidden is not None
    np.testing.assert_array_equal(replayed.token_hidden.view(np.uint32), eager.token_hidden.view(np.uint32))
