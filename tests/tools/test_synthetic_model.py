"""tools/synthetic_model.py: a twin has its card's architecture, shapes and weight formats, loads
and runs in vkrt with finite logits, embeds a vocabulary of the card's size that round-trips
text; the committed cards cover the models tools/gpu_check.sh benchmarks."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest

from tests.models.conftest import Greedy
from tests.tools.conftest import load_tool
from vkrt.loader import load_model
from vkrt.models import build_model
from vkrt.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    return load_tool("synthetic_model")


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real-format model to record: tools/make_moe_bench.py's dense Qwen3, one layer
    (Q4_K matrices, F32 norms, a vocabulary of 8192)."""
    path = tmp_path_factory.mktemp("real") / "dense.gguf"
    load_tool("make_moe_bench")._write(path, "qwen3", 1, "q4_k", np.random.default_rng(0))
    return path


def _header(path: Path) -> tuple[dict[str, object], list[tuple[str, list[int], str]]]:
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith(("GGUF.", "tokenizer.", "general."))}
    return meta, [(t.name, [int(n) for n in t.shape], t.tensor_type.name) for t in reader.tensors]


def test_a_twin_has_the_shapes_and_formats_of_the_model_it_was_recorded_from(real: Path, tmp_path: Path,
                                                                             ref) -> None:
    tool = _tool()
    card, twin = tmp_path / "dense.json", tmp_path / "dense.synthetic.gguf"
    tool.record(real, card)
    tool.write(card, twin, seed=0)
    assert _header(twin) == _header(real)
    assert not (tmp_path / "dense.synthetic.gguf.partial").exists()
    original, synthetic = load_model(real), load_model(twin)
    assert synthetic.config.name == "synthetic twin of dense.gguf"
    assert replace(synthetic.config, name=original.config.name) == original.config
    assert {k: (w.fmt, w.shape) for k, w in synthetic.weights.items()} == \
        {k: (w.fmt, w.shape) for k, w in original.weights.items()}
    assert not np.array_equal(synthetic.weights["layers.0.q_proj"].data, original.weights["layers.0.q_proj"].data)
    logits = Greedy(build_model(synthetic, ref), max_len=16).step([3, 1, 4, 1, 5], 0, all_logits=True)
    assert logits.shape == (5, original.config.vocab_size) and np.isfinite(logits).all()
    tool.write(card, tmp_path / "again.gguf", seed=0)
    assert (tmp_path / "again.gguf").read_bytes() == twin.read_bytes(), "a seed gives one file"


def test_the_vocabulary_has_the_asked_size_and_round_trips_text(real: Path, tmp_path: Path) -> None:
    tool = _tool()
    tokens, merges = tool.vocabulary(3000)
    assert len(tokens) == len(set(tokens)) == 3000 and tokens[-1] == tool.EOS
    known = set(tokens[:256])
    for merge in merges:  # every merge joins two tokens made before it
        left, right = merge.split(" ")
        assert left in known and right in known, merge
        known.add(left + right)
    card = tmp_path / "dense.json"
    tool.record(real, card)
    twin = tmp_path / "dense.synthetic.gguf"
    tool.write(card, twin, seed=1)
    tok = Tokenizer.from_gguf(twin)
    text = "Synthetic weights, real shapes: 42 tokens per step!"
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(SystemExit, match="under the 256 bytes"):
        tool.vocabulary(100)


def test_the_cards_cover_the_models_gpu_check_benchmarks() -> None:
    script = (REPO / "tools" / "gpu_check.sh").read_text()
    names = re.search(r"declare -A MODEL_NAME=\((.*)\)", script)
    assert names is not None
    for name in re.findall(r"\]=([\w.-]+)", names.group(1)):
        card = json.loads((REPO / "tools" / "model_cards" / f"{name}.json").read_text())
        shapes = {t[0]: t[1] for t in card["tensors"]}
        assert shapes["token_embd.weight"][-1] == card["vocab_size"], name
        assert card["metadata"]["general.architecture"]["value"] in ("llama", "gemma3"), name
