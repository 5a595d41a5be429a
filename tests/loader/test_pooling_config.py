"""What checkpoints say about pooling: sentence-transformers' modules, GGUF's pooling_type, a
sequence-classification head, and the clear errors for what vkrt does not run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_files import V, write_gguf

from vkrt.errors import UnsupportedModelError
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
    assert gguf_pooling(path, None) == {} and gguf_pooling(path, 0) == {}
    assert gguf_pooling(path, 1) == {"pooling": "mean", "pooling_normalize": True}
    assert gguf_pooling(path, 3)["pooling"] == "last"
    with pytest.raises(UnsupportedModelError, match="pooling_type 4"):
        gguf_pooling(path, 4)
