"""Prefix caching on a model whose every layer slides (tiny_mistral, window 8): a hit needs only
the window's last blocks, so it must never take them from a prompt that differs earlier."""

from __future__ import annotations

from tests.conftest import FIXTURES
from vkrt.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
SHARED = [(31 * i + 7) % 256 for i in range(36)]  # the later blocks both prompts have


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float], int]:
    [out] = llm.generate([prompt], GREEDY)
    return out.token_ids, [lp.token.logprob for lp in out.outputs[0].logprobs], out.num_cached_tokens


def test_sliding_window_hits_only_prompts_with_the_same_prefix() -> None:
    first, second = [5] * 16 + SHARED, [9] * 16 + SHARED  # block 0 differs, blocks 1-2 are equal
    cached = LLM(FIXTURES / "tiny_mistral", device="vulkan", max_model_len=64, max_num_seqs=2, kv_dtype="f32")
    plain = LLM(FIXTURES / "tiny_mistral", device="vulkan", max_model_len=64, max_num_seqs=2, kv_dtype="f32",
                enable_prefix_caching=False)
    run(cached, first)
    ids, logprobs, hit = run(cached, second)
    assert hit == 0, f"{hit} tokens of another prompt's blocks were reused"
    assert (ids, logprobs) == run(plain, second)[:2]
    again = run(cached, first)
    assert again[2] > 0 and again[:2] == run(plain, first)[:2]  # a real hit still equals no cache
