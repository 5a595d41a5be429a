"""tools/kv_memory.py's table must say what the engine really allocates for a sequence."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.tools.conftest import load_tool
from vkrt.engine.config import EngineConfig
from vkrt.engine.kv_groups import size_kv_pools
from vkrt.loader import load_model
from vkrt.models.base import kv_groups

REPO = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    return load_tool("kv_memory")


@pytest.mark.parametrize("fixture", ["tiny_gemma3", "tiny_llama"])
@pytest.mark.parametrize("context", [16, 100, 512])
def test_sequence_bytes_equal_the_engines_pools(fixture: str, context: int) -> None:
    tool = _tool()
    shape = tool.shape_of(str(REPO / "tests" / "fixtures" / fixture))
    config = load_model(REPO / "tests" / "fixtures" / fixture).config
    engine = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, block_size=16)
    kv = kv_groups(config)
    per_block = [2 * len(g.layers) * engine.block_size * config.num_kv_heads * config.head_dim * 2 for g in kv]
    pools = size_kv_pools(engine, kv, per_block, context)
    want = sum(n * b for n, b in zip(pools, per_block, strict=True))
    assert tool.sequence_bytes(shape, context, 2, engine) == want
    if fixture == "tiny_gemma3" and context == 512:
        assert want < tool.sequence_bytes(tool.KVShape("", shape.kv_heads, shape.head_dim,
                                                       (0,) * len(shape.windows)), context, 2, engine)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
def test_bytes_per_value_equal_the_models_block_bytes(kv_dtype: str) -> None:
    """--kv-cache-dtype q8_0 (and the others): the tool's bytes per value are the model's."""
    from vkrt.backend import get_backend
    from vkrt.models import build_model

    tool = _tool()
    fixture = REPO / "tests" / "fixtures" / "tiny_llama_hd32"
    shape = tool.shape_of(str(fixture))
    model = build_model(load_model(fixture), get_backend("reference"))
    engine = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, block_size=16)
    per_block = model.kv_group_bytes_per_block(engine.block_size, kv_dtype)
    pools = size_kv_pools(engine, model.kv_groups(), per_block, 100)
    want = sum(n * b for n, b in zip(pools, per_block, strict=True))
    assert tool.sequence_bytes(shape, 100, tool.bytes_per_value(kv_dtype), engine) == want
