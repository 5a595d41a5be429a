"""What checkpoints say about pooling: sentence-transformers' modules, GGUF's pooling_type, a
sequence-classification head, and the clear errors for what vkrt does not run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from loader_fixtures import hf_weights
from model_files import SMALL, V, write_gguf

from vkrt.engine.config import EngineConfig
from vkrt.engine.engine import EngineCore
from vkrt.engine.pooling import PoolingParams
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import load_model
from vkrt.loader.pooling import gguf_pooling

FIXTURES = Path(__file__).parents[1] / "fixtures"


def copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def test_qwen3_embedding_layout_is_read_as_last_token_normalised_matryoshka() -> None:
    config = load_model(FIXTURES / "tiny_qwen3_embed").config
    assert (config.pooling, config.pooling_normalize, config.matryoshka, config.num_labels) == ("last", True, True, 0)
    assert config.tie_word_embeddings  # its base-model tensors (no "model." prefix, no LM head) loaded


def test_a_plain_causal_lm_declares_no_pooling() -> None:
    config = load_model(FIXTURES / "tiny_qwen3").config
    assert (config.pooling, config.pooling_normalize, config.matryoshka) == ("", True, False)


def test_mean_pooling_without_normalize(tmp_path: Path) -> None:
    model = copy("tiny_qwen3_embed", tmp_path)
    modules = json.loads((model / "modules.json").read_text())[:2]
    (model / "modules.json").write_text(json.dumps(modules))
    pooling = model / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}))
    config = load_model(model).config
    assert (config.pooling, config.pooling_normalize, config.matryoshka) == ("mean", False, False)


@pytest.mark.parametrize("change", ["dense", "max"])
def test_sentence_transformers_modules_vkrt_does_not_run_are_refused(tmp_path: Path, change: str) -> None:
    model = copy("tiny_qwen3_embed", tmp_path)
    if change == "dense":
        modules = json.loads((model / "modules.json").read_text())
        modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
        (model / "modules.json").write_text(json.dumps(modules))
        match = "Dense"
    else:
        (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
        match = "pooling_mode_max_tokens"
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(model)


def test_sequence_classification_head_is_the_lm_head() -> None:
    loaded = load_model(FIXTURES / "tiny_qwen3_seqcls")
    assert loaded.config.num_labels == 1 and not loaded.config.tie_word_embeddings
    assert loaded.weights["lm_head"].shape == (1, loaded.config.hidden_size)


def test_a_gguf_pooling_type_is_read(tmp_path: Path) -> None:
    config = load_model(write_gguf(tmp_path / "m.gguf", metadata={"llama.pooling_type": (2, V.UINT32)})).config
    assert (config.pooling, config.pooling_normalize) == ("cls", True)
    assert load_model(write_gguf(tmp_path / "plain.gguf")).config.pooling == ""


def test_gguf_pooling_types() -> None:
    path = Path("m.gguf")
    assert gguf_pooling(path, None, None, {}) == {} and gguf_pooling(path, 0, None, {}) == {}
    assert gguf_pooling(path, 1, None, {}) == {"pooling": "mean", "pooling_normalize": True}
    assert gguf_pooling(path, 3, None, {})["pooling"] == "last"
    with pytest.raises(UnsupportedModelError, match="pooling_type 7"):
        gguf_pooling(path, 7, None, {})
    with pytest.raises(ModelFormatError, match="needs a"):
        gguf_pooling(path, 4, None, {})


def last_logits(model: Path, ids: list[int]) -> np.ndarray:
    core = EngineCore.from_config(EngineConfig(model=str(model), device="reference", max_model_len=64, kv_dtype="f32"))
    core.add(core.make_pooling_request("r", ids, PoolingParams("last", logits=True)))
    while core.has_unfinished():
        for output in core.step():
            assert output.pooling is not None and output.pooling.logits is not None
            return output.pooling.logits
    raise AssertionError("no output")


def test_a_gguf_rank_head_is_the_lm_head(tmp_path: Path) -> None:
    """llama.cpp's converter writes Qwen3-Reranker as pooling type rank with the LM head's yes and no
    rows as cls.output: that head's logits are the causal LM's logits of those two tokens."""
    yes, no = 40, 7
    head = hf_weights(SMALL, tied=True)["embed_tokens"][[yes, no]]
    rank = write_gguf(tmp_path / "rank.gguf", extra_tensors={"cls.output.weight": head},
                      metadata={"llama.pooling_type": (4, V.UINT32),
                                "llama.classifier.output_labels": (["yes", "no"], V.ARRAY)})
    config = load_model(rank).config
    assert (config.num_labels, config.classifier_labels, config.pooling) == (2, ("yes", "no"), "last")
    ids = [3, 50, 9, 12, 200]
    np.testing.assert_allclose(last_logits(rank, ids), last_logits(write_gguf(tmp_path / "lm.gguf"), ids)[[yes, no]],
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelFormatError, match="no pooling_type rank"):
        load_model(write_gguf(tmp_path / "odd.gguf", extra_tensors={"cls.output.weight": head}))
