"""A small numpy CausalLM and a byte-level tokenizer for engine tests.

FakeLM's logits at a token depend on that token, its position and the keys of every earlier
position *as read back from the paged KV cache*, so a block-table, slot, prefix-cache or
preemption bug changes the tokens. `reference_logits` computes the same function directly
from the token list, without any cache: the independent expectation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from vkrt.backend import get_backend
from vkrt.core.tensor import Tensor
from vkrt.engine import LLM
from vkrt.engine.config import SamplingParams
from vkrt.loader.config import LoadedModel, ModelConfig
from vkrt.models.base import CausalLM, KVCache, StepTensors
from vkrt.tokenizer import Tokenizer, _unicode_to_byte

EOS = 256
VOCAB = 260


class FakeLM(CausalLM):
    def __init__(self, loaded: LoadedModel | None = None, backend: Any = None, *, dim: int = 8,
                 max_len: int = 256, seed: int = 0) -> None:
        self.backend = backend or get_backend("reference")
        self.config = ModelConfig(
            architecture="fake", vocab_size=VOCAB, hidden_size=dim, intermediate_size=dim, num_layers=1,
            num_heads=1, num_kv_heads=1, head_dim=dim, max_position_embeddings=max_len, eos_token_ids=(EOS,))
        rng = np.random.default_rng(seed)
        self.embed = rng.normal(size=(VOCAB, dim))
        self.pos_embed = rng.normal(size=(max_len, dim)) * 0.5
        self.unembed = rng.normal(size=(dim, VOCAB)) * 1.5
        self.steps: list[tuple[int, int]] = []  # (num_tokens, num_seqs) per forward

    def _keys(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return (self.embed[token_ids] + self.pos_embed[positions]).astype(np.float32)

    def _logits(self, key: np.ndarray, context: np.ndarray) -> np.ndarray:
        hidden = key.astype(np.float64) + context.astype(np.float64).mean(axis=0)
        return np.tanh(hidden) @ self.unembed

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        read = self.backend.read
        ids, pos, seq, slots = (read(t) for t in (step.token_ids, step.positions, step.seq_index, step.slots))
        tables, rows = read(step.block_tables), read(step.logits_index)
        self.steps.append((int(ids.shape[0]), int(tables.shape[0])))
        bs = kv.block_size
        cache = read(kv.keys[0]).reshape(-1, self.config.head_dim)
        keys = self._keys(ids, pos)
        cache[slots] = keys
        self.backend.write(kv.keys[0], cache.reshape(kv.keys[0].shape))
        logits = np.empty((rows.shape[0], self.config.vocab_size), np.float32)
        for r, t in enumerate(rows):
            n = np.arange(pos[t] + 1)
            context_slots = tables[seq[t]][n // bs] * bs + n % bs
            logits[r] = self._logits(keys[t], cache[context_slots])
        return self.backend.upload(logits, "f32")

    def reference_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits after every position of `token_ids`, computed without any KV cache."""
        keys = self._keys(np.asarray(token_ids), np.arange(len(token_ids)))
        return np.stack([self._logits(keys[i], keys[: i + 1]) for i in range(len(token_ids))]).astype(np.float32)

    def reference_greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(np.argmax(self.reference_logits(ids)[-1])))
        return ids[len(prompt):]


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


MULTI_CHAR = {257: "ST", 258: "OPx", 259: "yz"}  # tokens spanning several characters


def byte_tokenizer() -> Tokenizer:
    """Token id b < 256 is byte b; 256 is <eos> (special); 257-259 are MULTI_CHAR."""
    vocab = dict(_unicode_to_byte())  # GPT-2's printable character per byte -> that byte
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])
    tok.add_tokens([AddedToken(text, special=False, normalized=False) for text in MULTI_CHAR.values()])
    assert tok.token_to_id("<eos>") == EOS and tok.get_vocab_size() == VOCAB
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=[EOS], chat_template=CHAT_TEMPLATE, byte_level=True)


class PoisonedLM(FakeLM):
    """FakeLM whose logits after the token `poison` hold `value` (NaN or inf) in one column:
    what a corrupt weight or an overflow does to one request, not to the others."""

    def __init__(self, poison: int, value: float = float("nan")) -> None:
        super().__init__()
        self.poison, self.value = poison, value

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        logits = self.backend.read(super().forward(step, kv)).copy()
        ids, rows = self.backend.read(step.token_ids), self.backend.read(step.logits_index)
        logits[ids[rows] == self.poison, 7] = self.value
        return self.backend.upload(logits, "f32")


class FaultyLM(FakeLM):
    """FakeLM whose `nth` forward (1-based) raises `error` before touching the KV cache: a step
    the device refused (out of memory) or could not run (lost). `every`: that forward and all later."""

    def __init__(self, error: Exception, nth: int, every: bool = False) -> None:
        super().__init__()
        self.error, self.nth, self.every = error, nth, every
        self.forwards = 0

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        self.forwards += 1
        if self.forwards == self.nth or (self.every and self.forwards > self.nth):
            raise self.error
        return super().forward(step, kv)


# chi-square with 3 degrees of freedom: P(X > 16.27) = 1e-3
CHI2_3DF_1E3 = 16.27


def assert_follows_top4(llm: LLM, context: list[int], draws: list[int]) -> None:
    """`draws` of the token after `context` at temperature 1 with top_k 4 follow `llm`'s top-4
    distribution there: none outside it, and chi-square p > 1e-3 (a correct sampler fails once
    in a thousand runs)."""
    probe = llm.generate([context], SamplingParams(max_tokens=1, temperature=0.0, logprobs=4))
    top = probe[0].outputs[0].logprobs
    assert top is not None
    support = [e.token_id for e in top[0].top]
    target = np.exp([e.logprob for e in top[0].top])
    counts = np.array([draws.count(t) for t in support])
    assert counts.sum() == len(draws), (support, draws)  # nothing outside the top-k
    expected = target / target.sum() * len(draws)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_3DF_1E3, (counts, expected)
