"""The multi-token-prediction head (vkrt/models/mtp.py) against its golden: the head composed from
transformers' modules on the same weights (tools/make_mtp_fixture.py), on both backends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FIXTURES
from vkrt.backend.base import Backend
from vkrt.errors import ModelFormatError
from vkrt.loader import load_model
from vkrt.models import ForwardBatch, StepTensors, build_model
from vkrt.models.decoder import DecoderModel
from vkrt.models.mtp import MTPHead, mtp_head_model

MTP_FIXTURES = ["tiny_qwen3_5_mtp", "tiny_qwen3_next_mtp", "tiny_glm4_moe_mtp", "tiny_deepseek_v3_mtp",
                # llama.cpp's converter on three of them: the MTP layer as a nextn block
                "tiny_qwen3_5_mtp_gguf", "tiny_qwen3_next_mtp_gguf", "tiny_glm4_moe_mtp_gguf"]
# Max |logit difference| against the golden: the families' own bound (tests/models/test_families.py);
# the head adds one layer and its fc to the target's forward.
MTP_LOGIT_ATOL = 2e-4
BLOCK = 16


class _Sequence:
    """One sequence through a model's paged cache (blocks in reverse order, as tests/models' Greedy)."""

    def __init__(self, model: DecoderModel, max_len: int = 64) -> None:
        self.backend: Backend = model.backend
        blocks = -(-max_len // BLOCK)
        self.kv = model.allocate_kv_cache(blocks, BLOCK)
        self.table = np.arange(blocks - 1, -1, -1, dtype=np.int32)[None, :]

    def step(self, tokens: list[int], start: int) -> StepTensors:
        n = len(tokens)
        pos = np.arange(start, start + n, dtype=np.int32)
        slots = (self.table[0][pos // BLOCK] * BLOCK + pos % BLOCK).astype(np.int32)
        batch = ForwardBatch(np.array(tokens, np.int32), pos, np.zeros(n, np.int32), slots, self.table,
                             np.arange(n, dtype=np.int32))
        return StepTensors.upload(self.backend, batch)


def mtp_fixture_path(name: str) -> Path:
    """The fixture's HF directory, or its GGUF file."""
    return FIXTURES / name / ("model.gguf" if name.endswith("_gguf") else "")


def _backend(device: str, request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue("ref" if device == "reference" else "vk_default")


@pytest.mark.parametrize("name", MTP_FIXTURES)
@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_mtp_head_matches_its_transformers_composition(name: str, device: str, request: pytest.FixtureRequest) -> None:
    """The target's final-norm hidden states feed the head; its logits at every prompt position and
    three chained guesses (each on the head's own guess and output) equal the golden's."""
    golden = json.loads((FIXTURES / name / "mtp_golden.json").read_text())
    backend = _backend(device, request)
    loaded = load_model(mtp_fixture_path(name))
    target = build_model(loaded, backend)
    assert isinstance(target, DecoderModel) and target.mtp_source is not None
    assert target.mtp_source.mtp_weights is loaded.mtp_weights and "layers.0.attn_norm" not in target.mtp_source.weights
    head = MTPHead(target, mtp_head_model(loaded))
    prompt = golden["prompt_ids"]
    n = len(prompt)

    seq = _Sequence(target)
    index = backend.upload(np.arange(n, dtype=np.int32), "i32", purpose="inputs")
    logits, normed = target.forward_pooled(seq.step(prompt, 0), seq.kv, index)
    assert int(logits.numpy()[-1].argmax()) == golden["next_token"]
    hidden = normed.numpy().reshape(n, -1)
    assert np.abs(hidden[-1] - np.array(golden["target_hidden_last"], np.float32)).max() <= MTP_LOGIT_ATOL

    head_seq = _Sequence(head)
    tokens = prompt[1:] + [golden["next_token"]]
    head_logits, out = head.forward_mtp(head_seq.step(tokens, 0), head_seq.kv,
                                        backend.upload(hidden, "f32", purpose="inputs"))
    rows = head_logits.numpy().reshape(n, -1)
    assert [int(v) for v in rows.argmax(-1)] == golden["head_argmax"]
    for r, expected in golden["head_logits_rows"].items():
        diff = float(np.abs(rows[int(r)] - np.array(expected, np.float32)).max())
        assert diff <= MTP_LOGIT_ATOL, f"{name} head row {r}: max |diff| {diff}"

    last_row, last_out = rows[-1], out.numpy().reshape(n, -1)[-1]
    for j, (guess, expected) in enumerate(zip(golden["guesses"], golden["guess_logits"], strict=True)):
        diff = float(np.abs(last_row - np.array(expected, np.float32)).max())
        assert diff <= MTP_LOGIT_ATOL, f"{name} guess {j + 1}: max |diff| {diff}"
        assert int(last_row.argmax()) == guess
        chained, chained_out = head.forward_mtp(head_seq.step([guess], n + j), head_seq.kv,
                                                backend.upload(last_out[None], "f32", purpose="inputs"))
        last_row, last_out = chained.numpy().reshape(-1), chained_out.numpy().reshape(-1)


def test_a_model_without_the_head_has_no_mtp_source(ref: Backend) -> None:
    assert build_model(load_model(FIXTURES / "tiny_qwen3_5"), ref).mtp_source is None


def test_an_incomplete_head_is_a_clear_error() -> None:
    loaded = load_model(FIXTURES / "tiny_qwen3_5_mtp")
    del loaded.mtp_weights["mtp.fc"]
    with pytest.raises(ModelFormatError, match="incomplete .*missing mtp.fc"):
        mtp_head_model(loaded)
