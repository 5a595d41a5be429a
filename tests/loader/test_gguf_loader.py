"""GGUF round trips: synthetic files written with gguf.GGUFWriter, read back by load_model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from loader_fixtures import TINY, converter_permute, hf_weights, write_llama_gguf

from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import load_model
from vkrt.loader.gguf_loader import unpermuted_qk_order

Q = gguf.GGMLQuantizationType


def test_config_from_metadata(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(128)
        w.add_eot_token_id(3)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)

    path = tmp_path / "m.gguf"
    write_llama_gguf(path, hf_weights(), metadata=extra)
    cfg = load_model(path).config
    assert cfg.architecture == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (TINY.vocab, TINY.hidden, TINY.intermediate)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 64)
    assert cfg.rms_norm_eps == 1e-5  # float32 metadata read back as its shortest decimal
    assert cfg.rope_theta == 500000.0
    assert cfg.max_position_embeddings == 512
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 128}
    assert cfg.bos_token_id == 1
    assert cfg.eos_token_ids == (2, 3)
    assert cfg.name == "tiny-llama"


def test_dims_reversed_and_float_data_exact(tmp_path: Path) -> None:
    weights = hf_weights()
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weights)
    model = load_model(path)
    down = model.weights["layers.1.down_proj"]
    assert down.shape == (TINY.hidden, TINY.intermediate)  # GGUF ne = [intermediate, hidden]
    assert down.fmt == "f32" and down.data.dtype == np.float32
    np.testing.assert_array_equal(down.data, weights["layers.1.down_proj"])
    np.testing.assert_array_equal(model.weights["final_norm"].data, weights["final_norm"])
    # Weights are views of the memory-mapped file, not copies.
    assert not down.data.flags.owndata


def test_unpermute_matches_converter_on_a_single_head() -> None:
    hf = np.arange(8, dtype=np.float32).reshape(8, 1)  # head_dim 8: halves [0..3], [4..7]
    gguf_rows = converter_permute(hf, 1)
    assert gguf_rows.ravel().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # interleaved pairs
    np.testing.assert_array_equal(gguf_rows[unpermuted_qk_order(8, 1)], hf)


def test_q_and_k_rows_come_back_in_hf_order(tmp_path: Path) -> None:
    weights = hf_weights(seed=3)
    path = tmp_path / "m.gguf"
    stored = write_llama_gguf(path, weights)
    assert not np.array_equal(stored["layers.0.q_proj"], weights["layers.0.q_proj"])  # really permuted
    model = load_model(path)
    for i in range(TINY.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            np.testing.assert_array_equal(model.weights[f"layers.{i}.{proj}"].rows(), weights[f"layers.{i}.{proj}"])
    # The file's rows are not copied to reorder them: q is read in HF order from the map.
    q = model.weights["layers.0.q_proj"]
    assert q.row_order is not None and not q.data.flags.owndata


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])
def test_block_bytes_preserved(tmp_path: Path, qtype: Q) -> None:
    weights = hf_weights()
    types = {name: qtype for name in weights if name.endswith(("_proj", "embed_tokens"))}
    path = tmp_path / "m.gguf"
    stored = write_llama_gguf(path, weights, types=types)
    model = load_model(path)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    up = model.weights["layers.0.up_proj"]
    assert up.fmt == qtype.name.lower()
    assert up.shape == (TINY.intermediate, TINY.hidden)
    assert up.data.dtype == np.uint8 and up.data.shape == (TINY.intermediate, TINY.hidden // block * size)
    np.testing.assert_array_equal(up.data, stored["layers.0.up_proj"])
    # q/k block rows are reordered whole: the result equals the stored rows un-permuted.
    q = model.weights["layers.1.q_proj"].rows()
    assert not np.array_equal(q, stored["layers.1.q_proj"])
    np.testing.assert_array_equal(converter_permute(q, TINY.heads), stored["layers.1.q_proj"])
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):  # row-wise quantization commutes with the row order
        np.testing.assert_array_equal(q, gguf.quants.quantize(weights["layers.1.q_proj"], qtype))
    assert model.file_type == qtype.name  # no general.file_type: majority of 2-D tensors


def test_f16_and_bf16_storage(tmp_path: Path) -> None:
    weights = hf_weights()
    types = {"layers.0.gate_proj": Q.F16, "layers.0.up_proj": Q.BF16, "layers.0.k_proj": Q.BF16}
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weights, types=types)
    model = load_model(path)
    gate, up, k = (model.weights[f"layers.0.{n}"] for n in ("gate_proj", "up_proj", "k_proj"))
    assert gate.fmt == "f16" and gate.data.dtype == np.float16
    np.testing.assert_array_equal(gate.data, weights["layers.0.gate_proj"].astype(np.float16))
    assert up.fmt == "bf16" and up.data.dtype == np.uint16 and up.shape == up.data.shape
    np.testing.assert_array_equal(up.data, weights["layers.0.up_proj"].view(np.uint32) >> 16)
    np.testing.assert_array_equal(k.rows(), weights["layers.0.k_proj"].view(np.uint32) >> 16)


def test_tied_and_untied(tmp_path: Path) -> None:
    write_llama_gguf(tmp_path / "tied.gguf", hf_weights(tied=True))
    tied = load_model(tmp_path / "tied.gguf")
    assert tied.config.tie_word_embeddings and "lm_head" not in tied.weights

    untied_weights = hf_weights(tied=False)
    write_llama_gguf(tmp_path / "untied.gguf", untied_weights)
    untied = load_model(tmp_path / "untied.gguf")
    assert not untied.config.tie_word_embeddings
    np.testing.assert_array_equal(untied.weights["lm_head"].data, untied_weights["lm_head"])


def test_file_type_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, hf_weights(), metadata=lambda w: w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1))
    model = load_model(path)
    assert model.file_type == "Q4_1"
    assert model.metadata["general.architecture"] == "llama"
    assert model.metadata["llama.block_count"] == TINY.layers
    assert "tokenizer.ggml.tokens" not in model.metadata


def test_real_smollm2(smollm2_path: Path) -> None:
    model = load_model(smollm2_path)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (576, 30, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert model.file_type == "Q4_1"
    assert model.weights["embed_tokens"].fmt == "q8_0"
    assert model.weights["layers.0.q_proj"].fmt == "q4_1"
    assert model.weights["layers.0.k_proj"].data.shape == (192, 576 // 32 * 20)


# ---- errors: one line naming the file --------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="nope.gguf: no such file"):
        load_model(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelFormatError, match=r"junk\.gguf: not a GGUF file"):
        load_model(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "cut.gguf"
    write_llama_gguf(path, hf_weights())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf: .*(truncated|corrupt)") as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    write_llama_gguf(path, hf_weights(), arch="mamba")
    with pytest.raises(UnsupportedModelError, match=r"mamba\.gguf: architecture 'mamba' is not supported"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "iq2.gguf"  # IQ2_XXS: a GGUF type no registered format decodes
    write_llama_gguf(path, hf_weights(), types={"layers.1.up_proj": Q.IQ2_XXS})
    with pytest.raises(UnsupportedModelError, match=r"iq2\.gguf: tensor 'blk\.1\.ffn_up\.weight' has type IQ2_XXS"):
        load_model(path)


def test_missing_tensor(tmp_path: Path) -> None:
    weights = hf_weights()
    del weights["layers.1.v_proj"]
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, weights)
    with pytest.raises(ModelFormatError, match=r"m\.gguf: weight 'layers\.1\.v_proj' is missing"):
        load_model(path)


def test_unknown_tensor(tmp_path: Path) -> None:
    path = tmp_path / "bias.gguf"
    bias = {"blk.0.attn_q.bias": np.zeros(TINY.heads * TINY.head_dim, np.float32)}
    write_llama_gguf(path, hf_weights(), extra_tensors=bias)
    with pytest.raises(UnsupportedModelError, match=r"bias\.gguf: tensor 'blk\.0\.attn_q\.bias'"):
        load_model(path)
