"""Host sampler: each parameter shapes the distribution as documented; seeds are per request."""

from __future__ import annotations

import numpy as np
import pytest

from vkrt.engine.config import SamplingParams
from vkrt.engine.request import Request
from vkrt.engine.sampler import (
    Sampler,
    apply_penalties_and_bias,
    filter_distribution,
    token_logprobs,
)

V = 32


def request(seed: int | None = 0, prompt: list[int] | None = None, **params: object) -> Request:
    return Request("r", prompt or [0], SamplingParams(seed=seed, **params), eos_token_ids=(V - 1,))  # type: ignore[arg-type]


def draws(logits: np.ndarray, n: int = 2000, **params: object) -> np.ndarray:
    """n tokens sampled from the same row by one seeded request (no output feedback)."""
    r = request(seed=123, **params)
    sampler = Sampler()
    return np.array([sampler.sample(logits[None], [r]).token_ids[0] for _ in range(n)])


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=V).astype(np.float32) * 2


def test_greedy_is_argmax(logits: np.ndarray) -> None:
    out = Sampler().sample(logits[None], [request(temperature=0.0)])
    assert out.token_ids == [int(np.argmax(logits))]


def test_top_k_1_equals_greedy(logits: np.ndarray) -> None:
    assert set(draws(logits, 200, temperature=1.5, top_k=1)) == {int(np.argmax(logits))}


def test_temperature_matches_softmax_frequencies(logits: np.ndarray) -> None:
    for temperature in (0.5, 2.0):
        expected = np.exp(logits / temperature - (logits / temperature).max())
        expected /= expected.sum()
        freq = np.bincount(draws(logits, 6000, temperature=temperature), minlength=V) / 6000
        assert np.abs(freq - expected).max() < 0.03


def test_top_k_keeps_only_the_k_most_likely(logits: np.ndarray) -> None:
    allowed = set(np.argsort(-logits)[:3].tolist())
    seen = set(draws(logits, 1000, top_k=3).tolist())
    assert seen == allowed


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = np.log(probs).astype(np.float32)
    assert set(draws(row, 1000, top_p=0.8).tolist()) == {0, 1}
    assert set(draws(row, 1000, top_p=0.81).tolist()) == {0, 1, 2}
    assert set(draws(row, 1000, top_p=0.3).tolist()) == {0}


def test_top_p_keeps_a_set_whose_mass_equals_p_exactly() -> None:
    """Four equal logits with top_p 0.5: two tokens hold exactly half the mass (in float32 too),
    so the smallest set reaching p is those two, not three."""
    kept = filter_distribution(np.zeros(4, np.float32), SamplingParams(temperature=1.0, top_p=0.5))
    assert np.count_nonzero(kept) == 2 and kept[0] > 0 and kept[1] > 0
    assert set(draws(np.zeros(4, np.float32), 400, top_p=0.5).tolist()) == {0, 1}


def test_min_p_filters_relative_to_the_top_token() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    row = np.log(probs).astype(np.float32)
    kept = filter_distribution(row.astype(np.float64), SamplingParams(min_p=0.2))
    assert np.flatnonzero(kept).tolist() == [0, 1, 2]  # 0.06 < 0.2 * 0.4
    assert set(draws(row, 1000, min_p=0.2).tolist()) == {0, 1, 2}


def test_repetition_penalty_follows_hf(logits: np.ndarray) -> None:
    params = SamplingParams(repetition_penalty=1.3)
    prompt, output = [1, 2, 3], [3, 4]
    out = apply_penalties_and_bias(logits, params, prompt, output, ())
    seen = [1, 2, 3, 4]
    for t in range(V):
        x = float(logits[t])
        want = (x / 1.3 if x > 0 else x * 1.3) if t in seen else x
        assert out[t] == pytest.approx(want, rel=1e-6)
    assert all(out[t] < logits[t] for t in seen)  # a repeated token always becomes less likely


def test_presence_and_frequency_penalties_count_output_tokens_only(logits: np.ndarray) -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties_and_bias(logits, params, [7, 7, 7], [5, 5, 5, 6], ())
    assert out[5] == pytest.approx(logits[5] - 0.5 - 3 * 0.25, rel=1e-6)
    assert out[6] == pytest.approx(logits[6] - 0.5 - 0.25, rel=1e-6)
    assert out[7] == pytest.approx(logits[7], rel=1e-6)  # prompt-only token untouched


def test_logit_bias_forces_and_bans(logits: np.ndarray) -> None:
    forced = int(np.argmin(logits))
    assert set(draws(logits, 200, logit_bias={forced: 100.0}).tolist()) == {forced}
    top = int(np.argmax(logits))
    out = Sampler().sample(logits[None], [request(temperature=0.0, logit_bias={top: -100.0})])
    assert out.token_ids[0] != top


def test_allowed_token_ids_restrict_every_path(logits: np.ndarray) -> None:
    """Greedy, top-k (a device-samplable request otherwise) and full sampling all stay inside the set,
    logprobs stay the raw model's."""
    allowed = [int(i) for i in np.argsort(logits)[:3]]  # the three least likely
    assert set(draws(logits, 300, allowed_token_ids=allowed).tolist()) <= set(allowed)
    assert set(draws(logits, 300, top_k=5, allowed_token_ids=allowed).tolist()) <= set(allowed)
    out = Sampler().sample(logits[None], [request(temperature=0.0, logprobs=0, allowed_token_ids=allowed)])
    best = max(allowed, key=lambda t: logits[t])
    assert out.token_ids == [best]
    entry = out.logprobs[0]
    assert entry is not None and entry.token.rank == V - allowed.index(best)


def test_min_tokens_masks_eos_and_stop_ids(logits: np.ndarray) -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    masked = apply_penalties_and_bias(logits, params, [0], [9], eos_token_ids=(V - 1,))
    assert np.isneginf(masked[[3, V - 1]]).all()
    unmasked = apply_penalties_and_bias(logits, params, [0], [9, 9], eos_token_ids=(V - 1,))
    assert np.isfinite(unmasked).all()
    ignored = apply_penalties_and_bias(logits, SamplingParams(min_tokens=2, ignore_eos=True), [0], [], (V - 1,))
    assert np.isfinite(ignored[V - 1])


def test_seeded_sampling_is_independent_of_the_batch() -> None:
    rng = np.random.default_rng(5)
    rows = rng.normal(size=(6, V)).astype(np.float32)
    sampler = Sampler()

    def run(seed: int, batch_size: int) -> list[int]:
        target = request(seed=seed)
        others = [request(seed=None) for _ in range(batch_size - 1)]
        tokens = []
        for step in range(12):
            batch = others[: step % batch_size] + [target] + others[step % batch_size:]
            logits = np.stack([rows[(step + i) % 6] for i in range(len(batch))])
            logits[batch.index(target)] = rows[step % 6]
            tokens.append(sampler.sample(logits, batch).token_ids[batch.index(target)])
        return tokens

    alone = run(7, 1)
    assert run(7, 4) == alone and run(7, 3) == alone
    assert run(8, 1) != alone


def test_logprobs_are_raw_model_logprobs(logits: np.ndarray) -> None:
    r = request(temperature=0.3, repetition_penalty=2.0, logprobs=3, logprob_token_ids=[0, 5])
    out = Sampler().sample(logits[None], [r])
    entry = out.logprobs[0]
    assert entry is not None
    expected = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    token = out.token_ids[0]
    assert entry.token.token_id == token
    assert entry.token.logprob == pytest.approx(expected[token], abs=1e-6)
    assert entry.token.rank == 1 + int((expected > expected[token]).sum())
    assert [lp.token_id for lp in entry.top] == np.argsort(-expected)[:3].tolist()
    assert [lp.rank for lp in entry.top] == [1, 2, 3]
    assert [lp.token_id for lp in entry.scored] == [0, 5]
    assert entry.scored[1].logprob == pytest.approx(expected[5], abs=1e-6)
    assert Sampler().sample(logits[None], [request()]).logprobs == [None]


def test_token_logprobs_are_log_softmax(logits: np.ndarray) -> None:
    """Every one of the V logprobs is the float64 log-softmax of its own logit, in rank order
    (summing to 1 alone would hold for any normalised distribution, e.g. a wrong row's)."""
    entry = token_logprobs(logits, 0, V)
    x = logits.astype(np.float64)
    expected = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    assert [lp.token_id for lp in entry.top] == np.argsort(-expected, kind="stable").tolist()
    np.testing.assert_allclose([lp.logprob for lp in entry.top], np.sort(expected)[::-1], rtol=0, atol=1e-6)
    assert entry.token.logprob == pytest.approx(expected[0], abs=1e-6)
