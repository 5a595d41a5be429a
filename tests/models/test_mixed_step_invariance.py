"""Batch invariance across attention paths, whole model: a sequence's decode logits are the
same bits in a decode-only step (replayed as the engine replays it) and in a step that mixes
that decode with another sequence's prefill (eager). With chunks of CHUNK positions forced
(GPUs chunk; CPU devices do not), the decode-only step gives each chunk of the context a
workgroup and merges the partials in a second pass, while the mixed step (enough tokens per
sequence) walks every row's chunks in one workgroup: both must merge to the same bits.

Families with GQA ratio 2 (two query heads per tile of the GQA kernel): tiny_llama,
tiny_mistral (sliding window 8 on every layer), tiny_gemma2 (attention softcap 5, sliding /
full layers); tiny_deepseek_v3 (multi-head latent attention: a tile of all 4 heads of 40 over its
one cached row, per-head expert matmuls that take one split in decode and the other beside a
prefill, grouped sigmoid MoE); f32 and f16 caches; and SmolLM2-135M (three heads per tile) with its default f16
cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import FIXTURES
from vkrt.backend.base import Backend
from vkrt.engine.runner import ModelRunner
from vkrt.loader import load_model
from vkrt.models import ForwardBatch, build_model

BLOCK = 16
PROMPT = [(29 * i + 5) % 256 for i in range(30)]  # decodes at positions 30.. cross a block edge
PREFILLS = [40, 9, 64]  # the other sequence's prompt in each mixed step
CHUNK = 8  # positions per chunk: the decodes' contexts (30..) span four chunks and more


def batch(kv_groups: int, seqs: list[tuple[list[int], int, np.ndarray]]) -> ForwardBatch:
    """One step: per sequence (tokens, first position, block-table row); logits for each last token."""
    ids, positions, seq_index, slots = [], [], [], []
    for s, (tokens, start, table) in enumerate(seqs):
        pos = np.arange(start, start + len(tokens))
        ids += tokens
        positions.append(pos)
        seq_index.append(np.full(len(tokens), s))
        slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
    ends = np.cumsum([len(tokens) for tokens, _, _ in seqs]) - 1
    slot_row = np.concatenate(slots).astype(np.int32)
    tables = np.stack([table for _, _, table in seqs]).astype(np.int32)
    return ForwardBatch(np.array(ids, np.int32), np.concatenate(positions).astype(np.int32),
                        np.concatenate(seq_index).astype(np.int32), np.stack([slot_row] * kv_groups),
                        np.stack([tables] * kv_groups), ends.astype(np.int32))


class Families:
    """Shader families each step dispatched (records during capture, not during replay)."""

    def __init__(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: set[str] = set()
        original = backend.run_shader  # type: ignore[attr-defined]

        def spy(name: str, *args: Any) -> Any:
            self.seen.add(name.split(".")[0])
            return original(name, *args)

        monkeypatch.setattr(backend, "run_shader", spy)

    def take(self) -> set[str]:
        seen, self.seen = self.seen, set()
        return seen


def check_decode_rows(model: Any, kv_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill PROMPT, then per step: a decode-only step, and the same decode beside a prefill."""
    from vkrt.backend.vulkan.kernels import attention as kernels

    monkeypatch.setattr(kernels, "paged_chunk", lambda caps: CHUNK)
    backend = model.backend
    kv = model.allocate_kv_cache(12, BLOCK, kv_dtype)
    groups = len(kv.num_blocks)
    runner = ModelRunner(model, kv, max_step_tokens=2, max_model_len=6 * BLOCK)
    table_a = np.array([7, 2, 9, 0, 0, 0])  # blocks in no order, so a kernel ignoring the table fails
    table_b = np.array([5, 11, 1, 4, 10, 3])
    families = Families(backend, monkeypatch)
    logits = runner.execute(batch(groups, [(PROMPT, 0, table_a)])).logits
    token = int(logits[-1].argmax())
    families.take()
    recorded: set[str] = set()
    for step, prefill in enumerate(PREFILLS):
        position = len(PROMPT) + step
        decode_only = runner.execute(batch(groups, [([token], position, table_a)])).logits
        assert runner.last_step.replayed
        recorded |= families.take()  # the step's kernels when it was recorded (empty on later replays)
        # The same decode again (it rewrites its own K/V with the same bits) beside a prefill.
        other = [(17 * i + step) % 256 for i in range(prefill)]
        mixed = runner.execute(batch(groups, [([token], position, table_a), (other, 0, table_b)])).logits
        seen = families.take()
        assert "paged_attention_gqa" in seen and "paged_attention_merge" not in seen
        np.testing.assert_array_equal(mixed[0].view(np.uint32), decode_only[0].view(np.uint32),
                                      err_msg=f"{kv_dtype}: decode at {position} beside a {prefill}-token prefill")
        token = int(decode_only[0].argmax())
    assert "paged_attention_merge" in recorded  # the decode-only step split its rows' chunks


@pytest.fixture
def gqa_kernel(vk_default: Backend) -> Backend:
    from vkrt.backend.vulkan.kernels import attention as kernels

    if kernels.gqa_lanes(vk_default.caps) is None:  # type: ignore[attr-defined]
        pytest.skip("no subgroup split here: every step runs the paged kernel")
    return vk_default


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mistral", "tiny_gemma2", "tiny_deepseek_v3"])
def test_decode_logits_do_not_depend_on_a_prefill_in_the_step(name: str, kv_dtype: str, gqa_kernel: Backend,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    check_decode_rows(build_model(load_model(FIXTURES / name), gqa_kernel), kv_dtype, monkeypatch)


def test_smollm2_decode_logits_do_not_depend_on_a_prefill_in_the_step(smollm2_path: Path, gqa_kernel: Backend,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M's shape (9 heads, 3 KV heads x 64: tiles of 3 heads), its default f16 cache."""
    check_decode_rows(build_model(load_model(smollm2_path), gqa_kernel), "f16", monkeypatch)
