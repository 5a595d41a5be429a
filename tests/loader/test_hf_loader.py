"""HF directories: config.json + safetensors (single and sharded; f32/f16/bf16)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from loader_fixtures import TINY, hf_config, hf_name, hf_weights, write_hf_dir, write_safetensors
from safetensors.numpy import save_file

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import load_model


def test_single_file_f32_written_by_safetensors(tmp_path: Path) -> None:
    weights = hf_weights(tied=False)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(
        architectures=["MistralForCausalLM"],
        head_dim=TINY.head_dim,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
        eos_token_id=[2, 5],
    )))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    save_file({hf_name(n): a for n, a in weights.items()}, str(model_dir / "model.safetensors"))
    model = load_model(model_dir)
    cfg = model.config
    assert cfg.architecture == "mistral"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (TINY.hidden, TINY.intermediate, TINY.layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (TINY.heads, TINY.kv_heads, TINY.head_dim)
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    assert cfg.eos_token_ids == (2, 5, 7)
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 1024
    assert not cfg.tie_word_embeddings
    assert model.file_type == "F32"
    assert set(model.weights) == set(weights)
    for name, array in weights.items():
        w = model.weights[name]
        assert w.fmt == "f32" and w.shape == array.shape
        np.testing.assert_array_equal(w.data, array)
    assert not model.weights["layers.0.q_proj"].data.flags.owndata  # memory-mapped


@pytest.mark.parametrize(("dtype", "fmt", "np_dtype"), [("F16", "f16", np.float16), ("BF16", "bf16", np.uint16)])
def test_sharded(tmp_path: Path, dtype: str, fmt: str, np_dtype: type) -> None:
    weights = hf_weights(tied=False)
    write_hf_dir(tmp_path / "m", weights, hf_config(), dtype=dtype, shards=3)
    assert len(list((tmp_path / "m").glob("*.safetensors"))) == 3
    model = load_model(tmp_path / "m")
    assert model.file_type == dtype
    assert set(model.weights) == set(weights)
    down = model.weights["layers.1.down_proj"]
    assert down.fmt == fmt and down.data.dtype == np_dtype and down.shape == (TINY.hidden, TINY.intermediate)
    expected = weights["layers.1.down_proj"]
    if dtype == "F16":
        np.testing.assert_array_equal(down.data, expected.astype(np.float16))
    else:
        np.testing.assert_array_equal(down.data, expected.view(np.uint32) >> 16)


def test_tied_drops_a_saved_lm_head(tmp_path: Path) -> None:
    weights = hf_weights(tied=False)
    write_hf_dir(tmp_path / "m", weights, hf_config(tie_word_embeddings=True))
    model = load_model(tmp_path / "m")
    assert model.config.tie_word_embeddings and "lm_head" not in model.weights


def test_rotary_inv_freq_ignored(tmp_path: Path) -> None:
    weights = hf_weights(tied=False)
    write_hf_dir(tmp_path / "m", weights, hf_config())
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", np.ones(32, np.float32))}
    write_safetensors(tmp_path / "m" / "extra.safetensors", extra)
    assert set(load_model(tmp_path / "m").weights) == set(weights)


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    config = hf_config(rope_parameters={"rope_theta": 50000.0, "rope_type": "linear", "factor": 2.0})
    del config["rope_theta"]
    write_hf_dir(tmp_path / "m", hf_weights(tied=False), config)
    cfg = load_model(tmp_path / "m").config
    assert cfg.rope_theta == 50000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# ---- errors ------------------------------------------------------------------------------


def test_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match=r"m: no config\.json.*pass that file instead"):
        load_model(tmp_path / "m")


def test_unsupported_architecture(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "m", hf_weights(), hf_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: architectures \['GPT2LMHeadModel'\]"):
        load_model(tmp_path / "m")


def test_unsupported_dtype(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "m", hf_weights(tied=False), hf_config())
    write_safetensors(tmp_path / "m" / "model.safetensors", {"model.norm.weight": ("F64", np.ones(4))})
    with pytest.raises(UnsupportedModelError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype F64"):
        load_model(tmp_path / "m")


def test_truncated_safetensors(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "m", hf_weights(tied=False), hf_config())
    file = tmp_path / "m" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: tensor .* truncated"):
        load_model(tmp_path / "m")


def test_missing_shard(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "m", hf_weights(tied=False), hf_config(), shards=2)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=r"index\.json: lists shard 'model-00002-of-00002\.safetensors'"):
        load_model(tmp_path / "m")


def test_untied_without_lm_head(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "m", hf_weights(tied=True), hf_config(tie_word_embeddings=False))
    with pytest.raises(ModelFormatError, match="no lm_head.weight"):
        load_model(tmp_path / "m")


def test_shape_disagreeing_with_config(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "m", hf_weights(tied=False), hf_config(num_key_value_heads=4))
    with pytest.raises(ModelFormatError, match=r"'layers\.0\.k_proj' has shape \(128, 256\).*\(256, 256\)"):
        load_model(tmp_path / "m")


def test_unknown_tensor(tmp_path: Path) -> None:
    weights = hf_weights(tied=False)
    write_hf_dir(tmp_path / "m", weights, hf_config())
    extra = {"model.layers.0.self_attn.q_proj.bias": ("F32", np.zeros(256, np.float32))}
    write_safetensors(tmp_path / "m" / "extra.safetensors", extra)
    with pytest.raises(UnsupportedModelError, match=r"extra\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(tmp_path / "m")


def test_sliding_window_is_per_layer_and_keeps_the_context(tmp_path: Path) -> None:
    """Mistral's sliding_window becomes every layer's attention window; the context is not cut."""
    import json
    import shutil

    from tests.conftest import FIXTURES
    from vkrt.loader import load_model

    model_dir = tmp_path / "windowed"
    shutil.copytree(FIXTURES / "tiny_llama", model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    cfg["sliding_window"] = 64
    (model_dir / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(model_dir).config
    assert loaded.max_position_embeddings == 256
    assert [layer.window for layer in loaded.layers] == [64, 64]
    cfg["sliding_window"] = None
    (model_dir / "config.json").write_text(json.dumps(cfg))
    assert [layer.window for layer in load_model(model_dir).config.layers] == [0, 0]


def _gpt_oss_mxfp4(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A copy of tiny_gpt_oss_mxfp4 (gpt-oss's released layout) and its tensors."""
    from safetensors.numpy import load_file

    from tests.conftest import FIXTURES

    model_dir = tmp_path / "m"
    shutil.copytree(FIXTURES / "tiny_gpt_oss_mxfp4", model_dir)
    return model_dir, load_file(model_dir / "model.safetensors")


def test_mxfp4_halves_join_into_llama_cpp_blocks(tmp_path: Path) -> None:
    """Split over two shards, each weight's _blocks in one and _scales in the other: the same
    weights as the single file, MXFP4 rows of the logical [experts, out, in] shapes."""
    model_dir, tensors = _gpt_oss_mxfp4(tmp_path)
    whole = load_model(model_dir).weights
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": {n: tensors[n] for n in names if not n.endswith("_scales")},
              "b.safetensors": {n: tensors[n] for n in names if n.endswith("_scales")}}
    for file, part in shards.items():
        save_file(part, str(model_dir / file))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    split = load_model(model_dir).weights
    assert split.keys() == whole.keys()
    gate = split["layers.0.experts.gate_proj"]
    assert (gate.fmt, gate.shape, gate.data.shape) == ("mxfp4", (4, 32, 64), (4, 32, 2 * 17))
    for name, w in whole.items():
        assert np.array_equal(w.data, split[name].data), name


def test_mxfp4_half_without_its_partner(tmp_path: Path) -> None:
    model_dir, tensors = _gpt_oss_mxfp4(tmp_path)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"layers\.1\.mlp\.experts\.down_proj_blocks has no partner"):
        load_model(model_dir)


def test_mxfp4_halves_that_do_not_match(tmp_path: Path) -> None:
    model_dir, tensors = _gpt_oss_mxfp4(tmp_path)
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = tensors["model.layers.0.mlp.experts.down_proj_scales"][:2]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="are not an MXFP4 pair"):
        load_model(model_dir)


def test_u8_tensor_that_is_not_mxfp4(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "m", hf_weights(tied=False), hf_config())
    write_safetensors(tmp_path / "m" / "model.safetensors", {"model.norm.weight": ("U8", np.ones(4, np.uint8))})
    with pytest.raises(UnsupportedModelError, match=r"'model\.norm\.weight' has dtype U8, which vkrt reads only as"):
        load_model(tmp_path / "m")
