"""The engine tells a model with no tokenizer (weights only: token-id prompts still work)
from a model whose tokenizer is present but corrupt (an error, not a silent degradation)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from model_files import V, byte_level_tokens, write_gguf

from vkrt.engine.config import EngineConfig
from vkrt.engine.engine import EngineCore
from vkrt.errors import ModelFormatError, NoTokenizerError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _engine(model: Path) -> EngineCore:
    return EngineCore.from_config(EngineConfig(model=str(model), device="reference", max_model_len=64,
                                               num_kv_blocks=8, kv_dtype="f32"))


def test_weights_only_model_loads_without_a_tokenizer(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vkrt"):
        engine = _engine(FIXTURES / "tiny_llama")
    assert engine.tokenizer is None
    assert "only token-id prompts will work" in caplog.text


def test_corrupt_gguf_vocabulary_fails_the_engine(tmp_path: Path) -> None:
    tokens = byte_level_tokens()
    tokens[ord("h")] = "H"  # a merge now builds a piece the vocabulary lacks
    path = write_gguf(tmp_path / "m.gguf", metadata={"tokenizer.ggml.tokens": (tokens, V.ARRAY)})
    with pytest.raises(ModelFormatError, match="tokenizer") as info:
        _engine(path)
    assert not isinstance(info.value, NoTokenizerError)
