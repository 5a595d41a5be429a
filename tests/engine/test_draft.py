"""Draft-model speculation (vkrt/engine/draft.py) over the FakeLM: the target is FakeLM, the draft
FakeLM itself (every proposal right) or a FakeLM with noise in its head (some right, some wrong),
sharing the byte tokenizer. Its logits read every earlier key back from the paged cache, so a
draft whose rolled-back K/V leaked into later proposals would still give the target's tokens
(the target verifies), but at a lower acceptance than the self-draft's 100%; and a target
whose cache kept a rejected proposal's K/V changes its tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from engine_fakes import VOCAB, FakeLM, FaultyLM, assert_follows_top4, byte_tokenizer

import vkrt.engine.draft as draft_module
from vkrt.engine import LLM
from vkrt.engine.config import SamplingParams
from vkrt.engine.draft import check_same_vocabulary
from vkrt.engine.guided import GuidedDecoding
from vkrt.engine.speculative import SpeculativeConfig, rejection_sample
from vkrt.errors import OutOfDeviceMemory, VkrtError
from vkrt.tokenizer import Tokenizer

PROMPTS = [list(b"the cat sat on the mat"), list(b"0123456789"), list(b"hello"), list(b"xyz")]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class NoisyLM(FakeLM):
    """FakeLM with noise added to its head: a draft that agrees with FakeLM on some tokens."""

    def __init__(self, noise: float = 0.6, seed: int = 7) -> None:
        super().__init__()
        self.unembed = self.unembed + np.random.default_rng(seed).normal(size=self.unembed.shape) * noise


def draft(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("draft_model", k, model="draft")


@pytest.fixture
def use_draft(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """use_draft(model, tokenizer=byte): what loading the draft model gives."""

    def install(model: FakeLM, tokenizer: Tokenizer | None = None) -> None:
        tok = tokenizer if tokenizer is not None else byte_tokenizer()
        monkeypatch.setattr(draft_module, "load_draft", lambda *_: (model, tok))

    return install


def _ids(llm: LLM, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


# ---- the config and the vocabulary check -----------------------------------------------------

def test_config_names_the_draft_model() -> None:
    assert SpeculativeConfig.parse({"model": "draft", "num_speculative_tokens": 5}) == draft(5)
    assert SpeculativeConfig.parse('{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2}') == \
        SpeculativeConfig("draft_model", 2, model="d.gguf")


def _renamed(token_id: int, text: str) -> Tokenizer:
    """The byte tokenizer with one token's text changed: a different vocabulary of the same size."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = byte_tokenizer()
    spec = tok.hf_json()
    old = next(t for t, i in tok.vocab().items() if i == token_id)
    hf = HFTokenizer.from_str(spec.replace(f'"{old}":{token_id}', f'"{text}":{token_id}', 1))
    return Tokenizer(hf, bos_token_id=None, eos_token_ids=[256], chat_template=None, byte_level=True)


def test_vocabularies_that_differ_are_refused_naming_the_token() -> None:
    target, tok = FakeLM(), byte_tokenizer()
    check_same_vocabulary("d", target, tok, NoisyLM(), byte_tokenizer())  # the same: accepted
    check_same_vocabulary("d", target, None, NoisyLM(), None)  # token ids only: sizes agree
    with pytest.raises(VkrtError, match="token 65 is 'A' in the target's vocabulary but '<x>' in the draft's"):
        check_same_vocabulary("d", target, tok, NoisyLM(), _renamed(65, "<x>"))
    with pytest.raises(VkrtError, match="the draft ships no tokenizer"):
        check_same_vocabulary("d", target, tok, NoisyLM(), None)
    small = FakeLM()
    small.config = type(small.config)(**{**small.config.__dict__, "vocab_size": VOCAB - 4})
    with pytest.raises(VkrtError, match=f"has {VOCAB - 4} tokens, the target's {VOCAB}"):
        check_same_vocabulary("d", target, tok, small, tok)


def test_the_engine_refuses_a_draft_with_another_vocabulary(make_llm: Callable[..., LLM],
                                                           use_draft: Callable[..., None]) -> None:
    use_draft(NoisyLM(), _renamed(66, "<y>"))
    with pytest.raises(VkrtError, match="must share the target's tokenizer"):
        make_llm(speculative=draft())


def test_a_missing_draft_model_is_a_clear_error(make_llm: Callable[..., LLM], tmp_path: Any) -> None:
    spec = SpeculativeConfig("draft_model", 2, model=str(tmp_path / "nowhere.gguf"))
    with pytest.raises(VkrtError, match="nowhere.gguf"):
        make_llm(speculative=spec)
    with pytest.raises(VkrtError, match="--speculative-config \"model\" 'no-such-model' is neither"):
        make_llm(speculative=SpeculativeConfig("draft_model", 2, model="no-such-model"))


# ---- the acceptance maths --------------------------------------------------------------------

def test_rejection_sampling_gives_p_exactly() -> None:
    """Enumerated: P(token t) = q(t) min(1, p(t)/q(t)) + sum_d q(d) (1 - min(1, p(d)/q(d))) r(t),
    r the normalised residual max(0, p - q), which is p(t) for any q; and rejection_sample's draws
    follow p (chi-square, 3 degrees of freedom, p > 1e-3)."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.6, 0.1, 0.2])
    accept = np.minimum(1.0, p / q)
    residual = np.maximum(p - q, 0.0)
    residual /= residual.sum()
    exact = q * accept + (q * (1.0 - accept)).sum() * residual
    np.testing.assert_allclose(exact, p, atol=1e-12)

    rng = np.random.default_rng(0)
    n = 20000
    drafts = rng.choice(4, size=n, p=q)
    counts = np.bincount([rejection_sample(p, q, int(d), rng) for d in drafts], minlength=4)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 16.27, counts
    # accepting every proposal would give q instead: far outside the bound
    assert float(((np.bincount(drafts, minlength=4) - n * p) ** 2 / (n * p)).sum()) > 1000


def test_rejection_sampling_when_draft_and_target_agree() -> None:
    p = np.array([0.25, 0.75])
    rng = np.random.default_rng(1)
    assert all(rejection_sample(p, p, 1, rng) == 1 for _ in range(100))  # p / q = 1: always accepted


# ---- the engine --------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size, k", [(4, 3), (4, 5), (16, 4)])
def test_self_draft_accepts_everything_and_keeps_the_ids(make_llm: Callable[..., LLM],
                                                         use_draft: Callable[..., None], block_size: int,
                                                         k: int) -> None:
    plain = _ids(make_llm(block_size=block_size), PROMPTS, GREEDY)
    use_draft(FakeLM())
    llm = make_llm(block_size=block_size, speculative=draft(k))
    steps: list[int] = []
    llm.engine.stats_listeners.append(lambda s: steps.append(s.num_generation_tokens))
    assert _ids(llm, PROMPTS, GREEDY) == plain
    spec = llm.engine.totals.spec
    assert spec.num_drafts > 0 and spec.acceptance_rate == 1.0, spec
    assert max(steps) == len(PROMPTS) * (k + 1)  # every request k + 1 tokens a step


def test_a_noisy_draft_keeps_the_target_ids_with_partial_acceptance(make_llm: Callable[..., LLM],
                                                                     use_draft: Callable[..., None]) -> None:
    plain = _ids(make_llm(block_size=4), PROMPTS, GREEDY)
    use_draft(NoisyLM())
    llm = make_llm(block_size=4, speculative=draft(4))
    assert _ids(llm, PROMPTS, GREEDY) == plain
    spec = llm.engine.totals.spec
    assert 0.1 < spec.acceptance_rate < 0.95, spec
    assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[-1]
    # every request finished: the draft's views are gone and its pool is whole again
    drafter = llm.engine.drafter
    assert drafter is not None and not drafter.views
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


def test_penalties_stops_and_opt_out_apply_per_token(make_llm: Callable[..., LLM],
                                                     use_draft: Callable[..., None]) -> None:
    cases = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=False)]
    prompts = [PROMPTS[0]] * len(cases)
    plain = make_llm().generate(prompts, cases)
    use_draft(NoisyLM(0.3))
    spec = make_llm(speculative=draft(4)).generate(prompts, cases)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp_a, lp_b = plain[1].outputs[0].logprobs, spec[1].outputs[0].logprobs
    assert lp_a is not None and lp_b is not None
    assert [round(e.token.logprob, 5) for e in lp_a] == [round(e.token.logprob, 5) for e in lp_b]


def test_concurrent_equals_sequential_with_preemption_and_abort(make_llm: Callable[..., LLM],
                                                                use_draft: Callable[..., None]) -> None:
    use_draft(NoisyLM(0.3))
    prompts = PROMPTS * 2
    params = [GREEDY if i % 3 else SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative=False)
              for i in range(len(prompts))]
    sequential = [_ids(make_llm(speculative=draft()), [p], s)[0] for p, s in zip(prompts, params, strict=True)]
    llm = make_llm(speculative=draft(), block_size=4, num_kv_blocks=40, max_num_seqs=8)
    assert _ids(llm, prompts, params) == sequential
    assert llm.engine.num_preemptions > 0
    # an aborted request's draft blocks go back with the next step
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.drafter is not None and "a" in engine.drafter.views
    engine.abort("a")
    engine.step()
    assert "a" not in engine.drafter.views
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert engine.drafter.blocks.num_free_blocks == engine.drafter.blocks.num_blocks


def test_chunked_prefill_and_a_token_budget_that_cuts_proposals(make_llm: Callable[..., LLM],
                                                                use_draft: Callable[..., None]) -> None:
    """Prompts prefilled in chunks of 8 and a budget that leaves some requests fewer proposals
    than the draft made: the ids stay plain decoding's, and the cut proposals count as not made."""
    plain = _ids(make_llm(), PROMPTS, GREEDY)
    use_draft(FakeLM())
    llm = make_llm(speculative=draft(4), max_num_batched_tokens=8)
    assert _ids(llm, PROMPTS, GREEDY) == plain
    spec = llm.engine.totals.spec
    assert spec.num_drafts > 0 and spec.acceptance_rate == 1.0, spec
    assert spec.num_draft_tokens < 4 * spec.num_drafts  # the budget of 8 cut some to fewer than 4


def test_a_draft_step_the_device_refuses_only_costs_its_proposals(make_llm: Callable[..., LLM],
                                                                  use_draft: Callable[..., None]) -> None:
    """The draft's 5th forward and every later one run out of memory: the requests go on
    decoding plainly, with the same ids, and the draft holds no blocks."""
    plain = _ids(make_llm(), PROMPTS, GREEDY)
    use_draft(FaultyLM(OutOfDeviceMemory("refused"), nth=5, every=True))
    llm = make_llm(speculative=draft())
    assert _ids(llm, PROMPTS, GREEDY) == plain
    drafter = llm.engine.drafter
    assert drafter is not None and llm.engine.totals.spec.num_drafts > 0
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent(make_llm: Callable[..., LLM],
                                                               use_draft: Callable[..., None]) -> None:
    use_draft(NoisyLM(0.3))
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=s, ignore_eos=True) for s in range(4)]
    first = _ids(make_llm(speculative=draft()), PROMPTS, params)
    assert _ids(make_llm(speculative=draft()), PROMPTS[1:2], params[1:2]) == first[1:2]
    assert _ids(make_llm(speculative=draft()), PROMPTS, params) == first


def test_sampled_tokens_keep_the_target_distribution(make_llm: Callable[..., LLM],
                                                     use_draft: Callable[..., None]) -> None:
    """Token 2 of many seeded requests whose first token was t: its distribution must be the
    target's top-4 at temperature 1 after t (chi-square, p > 1e-3), though the noisy draft's
    proposals follow another distribution (close enough that always accepting, or resampling
    from p rather than the residual, fails by far)."""
    prompt = list(b"dist")
    top_k = 4
    use_draft(NoisyLM(0.5))
    n = 800
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=s, ignore_eos=True) for s in range(n)]
    llm = make_llm(speculative=draft(1), max_num_seqs=64)
    outs = _ids(llm, [prompt] * n, params)
    first = max(set(o[0] for o in outs), key=[o[0] for o in outs].count)
    seconds = [ids[1] for ids in outs if ids[0] == first]
    assert len(seconds) > 100
    assert_follows_top4(make_llm(), prompt + [first], seconds)
    spec = llm.engine.totals.spec
    assert spec.num_drafts >= n and 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec


def test_constrained_requests_take_a_greedy_drafts_proposals_only(make_llm: Callable[..., LLM],
                                                                   use_draft: Callable[..., None]) -> None:
    """A noisy draft proposes tokens the grammar rejects: a greedy constrained request keeps the
    accepted prefix of them and decodes what plain constrained decoding does; a sampling one
    takes none (cutting a sampled draft token would change the distribution)."""
    digits = GuidedDecoding("regex", "[0-9]{40}")
    greedy = SamplingParams(max_tokens=30, temperature=0.0, guided_decoding=digits)
    plain = _ids(make_llm(block_size=4), PROMPTS[1:2], greedy)
    use_draft(NoisyLM())
    llm = make_llm(block_size=4, speculative=draft(4))
    assert _ids(llm, PROMPTS[1:2], greedy) == plain
    spec = llm.engine.totals.spec
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0, spec
    llm.engine.reset_totals()
    [sampled] = _ids(llm, PROMPTS[1:2], SamplingParams(max_tokens=30, temperature=0.8, seed=1, guided_decoding=digits))
    assert llm.engine.totals.spec.num_drafts == 0 and bytes(sampled).isdigit() and len(sampled) == 30
