"""Speculative decoding (vkrt/engine/speculative.py): the config, the n-gram proposer, and the
engine's verify steps over the FakeLM, whose logits read every earlier key back from the paged
cache, so a proposal's K/V left behind after a rejection, or a block given back too early,
changes the tokens. Proposals come from the real proposer, or from an oracle that knows the
plain run's tokens and is wrong where a test says, to drive acceptance exactly."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

import pytest
from engine_fakes import assert_follows_top4

import vkrt.engine.engine as engine_module
from vkrt.engine import LLM
from vkrt.engine.config import SamplingParams
from vkrt.engine.guided import GuidedDecoding
from vkrt.engine.speculative import (
    MAX_BACKOFF,
    SpecStats,
    SpeculativeConfig,
    backoff_after,
    ngram_proposal,
    proposal_length,
)
from vkrt.errors import VkrtError

NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
REPEATING = [list(b"abcabcabcabc the cat sat on the mat, the cat sat on the"), list(b"0123456789" * 3),
             list(b"hello hello hello"), list(b"xyz")]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


# ---- the config ---------------------------------------------------------------------------

def test_config_takes_vllms_keys() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6}')
    assert config == SpeculativeConfig("ngram", 5, 6, 2)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}) == \
        SpeculativeConfig("ngram", 2, 6, 6)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(" ") is None


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "exceeds"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown key"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported yet"),
    ('{"method": "mtp"}', "num_speculative_tokens"),
    ('{"method": "mtp", "num_speculative_tokens": 1, "model": "d"}', "takes no model"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "takes no prompt_lookup_max"),
    ('{"method": "suffix", "num_speculative_tokens": 1}', "must be"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
    ('{"model": "", "num_speculative_tokens": 2}', "needs \"model\""),
    ('{"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "belong to method \"ngram\""),
    ('{"method": "ngram", "model": "d", "num_speculative_tokens": 2}', "takes none"),
    ('{"model": "d"}', "num_speculative_tokens"),
])
def test_config_errors_say_what(text: str, says: str) -> None:
    with pytest.raises(VkrtError, match=says):
        SpeculativeConfig.parse(text)


# ---- the proposer ---------------------------------------------------------------------------

def test_ngram_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 (followed by 9, 2, 3); [2, 3] also at 4 (followed by 7):
    # the longer match wins
    assert ngram_proposal(tokens, 3, 4, 2) == [9, 2, 3]
    assert ngram_proposal(tokens, 3, 2, 2) == [7, 8, 1]  # only bigrams: the latest, at 4
    # past the end of the tokens the copy goes on with the period it found
    assert ngram_proposal([5, 6, 7, 5, 6], 8, 3, 2) == [7, 5, 6, 7, 5, 6, 7, 5]
    assert ngram_proposal([1, 2, 3, 4], 3, 3, 1) == []  # nothing recurs
    assert ngram_proposal([1, 1], 2, 3, 1) == [1, 1]
    assert ngram_proposal([4, 4, 4, 4], 3, 2, 2) == [4, 4, 4]
    assert ngram_proposal([1, 2], 0, 3, 1) == []


def test_backoff_doubles_up_to_its_cap_and_ends_on_acceptance() -> None:
    waits = [0]
    for _ in range(8):
        waits.append(backoff_after(waits[-1], 0))
    assert waits[1:] == [1, 2, 4, 8, 16, 16, 16, 16] and MAX_BACKOFF == 16
    assert backoff_after(16, 1) == 0


def test_spec_stats_sum_and_report() -> None:
    total = SpecStats()
    step = SpecStats()
    step.record(3, 2)
    step.record(2, 0)
    total.add(step)
    total.add(step)
    assert total.num_drafts == 4 and total.num_draft_tokens == 10 and total.num_accepted_tokens == 4
    assert total.accepted_per_pos == [2, 2, 0]
    assert total.as_dict()["acceptance_rate"] == 0.4 and total.mean_accepted_length == 2.0


# ---- the engine ------------------------------------------------------------------------------

def _ids(llm: LLM, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[tuple[int, ...], list[int]], set[int]], None]]:
    """oracle(truth, wrong): proposals are the plain run's next tokens (truth maps a prompt to
    its plain continuation), except that proposal position i is wrong for i in `wrong`."""

    def install(truth: dict[tuple[int, ...], list[int]], wrong: set[int]) -> None:
        def propose(tokens: list[int], k: int, _max: int, _min: int) -> list[int]:
            for prompt, rest in truth.items():
                n = len(prompt)
                if tuple(tokens[:n]) == prompt:
                    done = len(tokens) - n
                    proposal = rest[done:done + k]
                    return [(t + 1) % 256 if i in wrong else t for i, t in enumerate(proposal)]
            return []

        monkeypatch.setattr(engine_module, "ngram_proposal", propose)

    yield install


@pytest.mark.parametrize("block_size", [4, 16])
def test_ngram_greedy_ids_equal_plain(make_llm: Callable[..., LLM], block_size: int) -> None:
    plain = _ids(make_llm(block_size=block_size), REPEATING, GREEDY)
    llm = make_llm(block_size=block_size, speculative=NGRAM)
    assert _ids(llm, REPEATING, GREEDY) == plain
    spec = llm.engine.totals.spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_drafts


def _oracle_run(make_llm: Callable[..., LLM], oracle: Callable[..., None], params: SamplingParams,
                wrong: set[int]) -> tuple[list[int], SpecStats]:
    """Plain decoding's tokens for a 33-token request, then the same request with the oracle's
    proposals (wrong at `wrong`) on 4-token blocks: the tokens must be the same. The tokens
    emitted per step, and the speculation counters."""
    prompt = list(b"speculate")
    [truth] = _ids(make_llm(block_size=4), [prompt], params)
    oracle({tuple(prompt): truth}, wrong)
    llm = make_llm(block_size=4, speculative=NGRAM)
    steps: list[int] = []
    llm.engine.stats_listeners.append(lambda s: steps.append(s.num_generation_tokens))
    assert _ids(llm, [prompt], params) == [truth]
    return steps, llm.engine.totals.spec


@pytest.mark.parametrize("wrong, per_step", [(set(), 4), ({0}, 1), ({1}, 2), ({2}, 3)])
def test_acceptance_stops_at_the_first_wrong_proposal(make_llm: Callable[..., LLM], oracle: Callable[..., None],
                                                      wrong: set[int], per_step: int) -> None:
    params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    steps, spec = _oracle_run(make_llm, oracle, params, wrong)
    # the prefill's token, then per_step tokens a step (the accepted proposals and the
    # target's own), the last step cut by max_tokens
    assert steps[0] == 1 and set(steps[1:-1]) == {per_step} and sum(steps) == 33
    if wrong:  # positions before the wrong one are accepted, none from it on
        (j,) = wrong
        assert all(spec.accepted_per_pos[:j]) and not any(spec.accepted_per_pos[j:]), spec
    else:  # k = 3 proposals, all right: 4 tokens a step across block boundaries of 4
        assert spec.acceptance_rate == 1.0


def test_proposal_length_fills_token_tiles() -> None:
    """Full acceptance doubles the length (2n + 1), a rejection cuts it to the smallest 2^m - 1
    above the accepted ones, never past k nor below 1."""
    assert [proposal_length(p, p, 7) for p in (1, 3, 7)] == [3, 7, 7]
    assert [proposal_length(7, a, 7) for a in range(7)] == [1, 3, 3, 7, 7, 7, 7]
    assert proposal_length(3, 3, 2) == 2 and proposal_length(5, 0, 32) == 1


@pytest.mark.parametrize("wrong, lengths", [(set(), [7, 7]), ({1}, [7, 3, 3]), ({0}, [7, 1]), ({4}, [7, 7, 7])])
def test_requests_propose_as_many_as_their_last_step_earned(make_llm: Callable[..., LLM], oracle: Callable[..., None],
                                                            wrong: set[int], lengths: list[int]) -> None:
    """k = 7: the first proposal is 7 tokens; then proposal_length of what the last verify step
    accepted (the ids equal plain decoding throughout)."""
    prompt = list(b"adaptive")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    [truth] = _ids(make_llm(block_size=4), [prompt], params)
    oracle({tuple(prompt): truth}, wrong)
    llm = make_llm(block_size=4, speculative=SpeculativeConfig("ngram", 7, 4, 2))
    proposed: list[int] = []
    llm.engine.stats_listeners.append(lambda s: proposed.append(s.spec.num_draft_tokens) if s.spec.num_drafts else None)
    assert _ids(llm, [prompt], params) == [truth]
    assert proposed[:len(lengths)] == lengths, proposed


def test_rollback_gives_back_the_blocks_rejected_proposals_took(make_llm: Callable[..., LLM],
                                                               oracle: Callable[..., None]) -> None:
    prompt = list(b"rollback!!")
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    [truth] = _ids(make_llm(block_size=4), [prompt], params)
    oracle({tuple(prompt): truth}, {0})  # every proposal rejected at once
    llm = make_llm(block_size=4, speculative=SpeculativeConfig("ngram", 8, 4, 2))
    request = llm.engine.add_request("r", prompt, params)
    held: list[tuple[int, int]] = []
    while llm.engine.has_unfinished():
        llm.engine.step()
        if not request.is_finished:
            blocks = llm.engine.block_manager.block_table("r")
            held.append((len(blocks), -(-request.num_tokens // 4)))
    assert request.output_token_ids == truth
    # after each step the request holds at most the blocks of its tokens, none a proposal's
    # (8 of them reach 2 blocks further)
    assert all(n <= need for n, need in held), held
    assert llm.engine.totals.spec.num_accepted_tokens == 0


def test_stop_strings_max_tokens_and_eos_end_inside_an_accepted_run(make_llm: Callable[..., LLM],
                                                                    oracle: Callable[..., None]) -> None:
    prompt = list(b"stop here")
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    [truth] = _ids(make_llm(), [prompt], base)
    oracle({tuple(prompt): truth}, set())
    tok = make_llm().tokenizer
    assert tok is not None
    stop = tok.decode(truth[9:11])  # a stop string that ends inside a run of accepted proposals
    cases = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]),
             SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[truth[6]])]
    plain = make_llm().generate([prompt] * 3, cases)
    spec = make_llm(speculative=SpeculativeConfig("ngram", 5, 4, 2)).generate([prompt] * 3, cases)
    for a, b in zip(plain, spec, strict=True):
        assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason) == \
            (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason)
    assert len(spec[0].outputs[0].token_ids) == 14


def test_penalties_logprobs_and_opt_out_apply_per_token(make_llm: Callable[..., LLM]) -> None:
    cases = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, frequency_penalty=0.5,
                            logit_bias={ord("c"): 3.0}),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=False)]
    prompts = [REPEATING[0]] * len(cases)
    plain = make_llm().generate(prompts, cases)
    llm = make_llm(speculative=NGRAM)
    spec = llm.generate(prompts, cases)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp_a, lp_b = plain[1].outputs[0].logprobs, spec[1].outputs[0].logprobs
    assert lp_a is not None and lp_b is not None and len(lp_b) == 30
    assert [(e.token.token_id, round(e.token.logprob, 5)) for e in lp_a] == \
        [(e.token.token_id, round(e.token.logprob, 5)) for e in lp_b]
    assert llm.engine.totals.spec.num_drafts > 0


def test_concurrent_equals_sequential_with_preemption(make_llm: Callable[..., LLM]) -> None:
    prompts = REPEATING * 2
    sequential = [_ids(make_llm(speculative=NGRAM), [p], GREEDY)[0] for p in prompts]
    # a pool too small for all eight at once: requests are preempted and recomputed
    llm = make_llm(speculative=NGRAM, block_size=4, num_kv_blocks=40, max_num_seqs=8)
    assert _ids(llm, prompts, GREEDY) == sequential
    assert llm.engine.num_preemptions > 0


def test_seeded_sampling_is_reproducible_with_speculation(make_llm: Callable[..., LLM]) -> None:
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=s, ignore_eos=True) for s in range(4)]
    first = _ids(make_llm(speculative=NGRAM), REPEATING, params)
    # alone or batched with others, the same seeds give the same tokens
    assert _ids(make_llm(speculative=NGRAM), REPEATING[1:2], params[1:2]) == first[1:2]
    assert _ids(make_llm(speculative=NGRAM), REPEATING, params) == first


def test_rejection_sampling_keeps_the_target_distribution(make_llm: Callable[..., LLM],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Token 2 of many seeded requests, each proposing one fixed token d after token 1: its
    distribution (given token 1) must be the target's top-4 at temperature 1 (chi-square,
    p > 1e-3, so a correct sampler fails it once in a thousand runs; always accepting d, or
    resampling without removing it, fail by far)."""
    prompt = list(b"dist")
    top_k = 4
    logprobs = make_llm().generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=top_k))
    entry = logprobs[0].outputs[0].logprobs
    assert entry is not None
    first = entry[0].token.token_id
    probe = make_llm().generate([prompt + [first]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=top_k))
    top = probe[0].outputs[0].logprobs
    assert top is not None
    d = top[0].top[1].token_id  # a proposal with middling probability

    def propose(tokens: list[int], k: int, _max: int, _min: int) -> list[int]:
        return [d] if len(tokens) == len(prompt) + 1 else []

    monkeypatch.setattr(engine_module, "ngram_proposal", propose)
    n = 1200
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=s, ignore_eos=True) for s in range(n)]
    llm = make_llm(speculative=SpeculativeConfig("ngram", 1, 4, 2), max_num_seqs=64)
    outs = _ids(llm, [prompt] * n, params)
    seconds = [ids[1] for ids in outs if ids[0] == first]
    assert len(seconds) > 100
    assert_follows_top4(make_llm(), prompt + [first], seconds)
    assert llm.engine.totals.spec.num_drafts >= len(seconds)


def test_prefix_cache_names_blocks_by_known_tokens_only(make_llm: Callable[..., LLM]) -> None:
    """A block is published to the prefix cache once its own tokens are known, never while
    proposals fill it: a follow-up request on a speculating request's output hits as many
    blocks as it would after plain decoding, and decodes the same tokens."""
    first = REPEATING[1]
    hits = {}
    # 5 tokens a verify step against blocks of 4: proposals fill blocks their tokens do not
    for name, spec in (("plain", None), ("spec", SpeculativeConfig("ngram", 4, 4, 2))):
        llm = make_llm(block_size=4, speculative=spec)
        [out] = _ids(llm, [first], GREEDY)
        follow = first + out[:25]
        before = llm.engine.block_manager.prefix_hits
        hits[name] = (_ids(llm, [follow], GREEDY), llm.engine.block_manager.prefix_hits - before)
    assert hits["spec"] == hits["plain"] and hits["plain"][1] >= 4 * ((len(first) + 25 - 1) // 4) - 4


# ---- structured output -----------------------------------------------------------------------

# Every position allows its own letters: a verify row masked as row 0 is would sample another
# token than plain decoding. The wrong proposals of the oracle ((t + 1) % 256) are never allowed
# where the right ones are ('a' -> 'b', 'b' / 'd' -> 'c' / 'e', 'e' -> 'f', ' ' -> '!').
ABE = GuidedDecoding("regex", "(a[bd]e ){10}")  # 40 bytes: more than any test's max_tokens


@pytest.mark.parametrize("wrong, per_step", [(set(), 4), ({1}, 2)])
def test_constrained_requests_verify_each_row_under_its_own_mask(make_llm: Callable[..., LLM],
                                                                 oracle: Callable[..., None],
                                                                 wrong: set[int], per_step: int) -> None:
    params = SamplingParams(max_tokens=33, temperature=0.0, guided_decoding=ABE)
    [plain] = _ids(make_llm(block_size=4), [list(b"speculate")], params)
    assert len(plain) == 33 and set(bytes(plain)) == set(b"abde ")  # b and d both chosen where either may come
    steps, spec = _oracle_run(make_llm, oracle, params, wrong)
    assert steps[0] == 1 and set(steps[1:-1]) == {per_step} and sum(steps) == 33
    assert spec.acceptance_rate == 1.0, spec
    if wrong:  # [right, wrong, right] was cut to its first token: the grammar rejects the second
        assert spec.num_draft_tokens == spec.num_drafts, spec


def test_constrained_ngram_speculation_equals_plain(make_llm: Callable[..., LLM]) -> None:
    """The real proposer on repeating prompts, several requests in a batch: greedy ones get the
    same tokens as plain constrained decoding, a seeded sampling one the same tokens run after
    run (not plain decoding's: a verify step draws once per row), every output inside its grammar."""
    params = [SamplingParams(max_tokens=30, temperature=0.0, guided_decoding=ABE),
              SamplingParams(max_tokens=30, temperature=0.9, seed=3, guided_decoding=ABE),
              SamplingParams(max_tokens=30, temperature=0.0, guided_decoding=GuidedDecoding("regex", "[0-9]{30}")),
              SamplingParams(max_tokens=30, temperature=0.0)]
    prompts = [list(b"abe abe adeabe ade"), list(b"abe ade abe ade"), REPEATING[1], REPEATING[0]]
    plain = _ids(make_llm(block_size=4), prompts, params)
    llm = make_llm(block_size=4, speculative=NGRAM)
    spec = _ids(llm, prompts, params)
    assert [spec[0], spec[2], spec[3]] == [plain[0], plain[2], plain[3]]
    assert _ids(make_llm(block_size=4, speculative=NGRAM), prompts[1:2], params[1:2]) == spec[1:2]
    for ids in (plain[0], plain[1], spec[1]):  # a prefix of the grammar's language, cut by max_tokens
        assert re.fullmatch("(a[bd]e ){7}a[bd]", bytes(ids).decode()), bytes(ids)
    assert re.fullmatch("[0-9]{30}", bytes(plain[2]).decode())
    assert llm.engine.totals.spec.num_accepted_tokens > 0
