"""Multi-head latent attention (DeepSeek-V3, GLM-4 MoE Lite): the cache holds one latent row per
token, the absorbed attention equals the expanded one, the config is checked and read alike from
both formats, MTP layers are skipped, the absorbed weights keep a 16-bit source's format, and a
decode step's dispatches are pinned.

Greedy ids and logits against transformers are in test_families.py (tiny_deepseek_v3,
tiny_glm4_moe_lite and their converted GGUFs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FIXTURES
from vkrt.backend.base import Backend
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader import load_model
from vkrt.loader.config import ModelConfig
from vkrt.models import ForwardBatch, StepTensors
from vkrt.models.decoder import DecoderModel
from vkrt.models.rope import rope_table
from vkrt.models.weights import LatentAttention

# fixture -> (layers, heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
SHAPES = {"tiny_deepseek_v3": (3, 4, 32, 8, 16, 16), "tiny_glm4_moe_lite": (3, 4, 32, 8, 16, 16)}


@pytest.mark.parametrize("name", [*SHAPES, "tiny_deepseek_v3_gguf/model.gguf"])
def test_cache_holds_the_latent_and_rope_key_per_token(name: str, vk_default: Backend) -> None:
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values (one tensor: the
    value is the key row), a quarter of what these heads' full K and V would take, as the
    device's allocator counts it."""
    layers, heads, rank, rope, nope, v = SHAPES[name.split("_gguf")[0]]
    model = DecoderModel(load_model(FIXTURES / name), vk_default)
    blocks, block_size = 4, 16
    latent_bytes = layers * (rank + rope) * 2  # f16, per token
    full_bytes = layers * heads * (nope + rope + v) * 2
    assert model.kv_bytes_per_block(block_size, "f16") == block_size * latent_bytes
    assert full_bytes == 4 * latent_bytes
    before = vk_default.memory_stats().get("kv_bytes", 0)
    kv = model.allocate_kv_cache(blocks, block_size, "f16")
    assert all(kv.values[i] is kv.keys[i] for i in range(layers))
    assert kv.nbytes == blocks * block_size * latent_bytes
    assert vk_default.memory_stats()["kv_bytes"] - before == kv.nbytes


def _expanded_attention(loaded: dict, p: str, x: np.ndarray, config: ModelConfig) -> np.ndarray:
    """transformers' MLA of one sequence x [T, hidden] (already normed), unabsorbed: every head's
    key [W_uk c, k_rope] and value W_uv c expanded from the latent, in float64."""
    c = config

    def w(name: str) -> np.ndarray:
        return np.asarray(loaded[p + name].rows(), np.float64)

    def rms(a: np.ndarray, g: np.ndarray) -> np.ndarray:
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + c.rms_norm_eps) * g

    table = rope_table(x.shape[0], c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, None).astype(np.float64)

    def rope(a: np.ndarray) -> np.ndarray:  # interleaved pairs over the last axis, positions 0..T-1
        half = c.qk_rope_head_dim // 2
        cos, sin = (part.reshape(a.shape[0], *([1] * (a.ndim - 2)), half) for part in (table[:, :half], table[:, half:]))
        even, odd = a[..., 0::2], a[..., 1::2]
        out = np.empty_like(a)
        out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, odd * cos + even * sin
        return out

    t, heads, nope, rank = x.shape[0], c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank
    q_in = x if not c.q_lora_rank else rms(x @ w("q_a_proj").T, w("q_a_norm"))
    q = (q_in @ w("q_b_proj" if c.q_lora_rank else "q_proj").T).reshape(t, heads, -1)
    kv_a = x @ w("kv_a_proj").T
    latent, k_rope = rms(kv_a[:, :rank], w("kv_a_norm")), rope(kv_a[:, rank:])
    kv = (latent @ w("kv_b_proj").T).reshape(t, heads, nope + c.v_head_dim)
    keys = np.concatenate([kv[..., :nope], np.broadcast_to(k_rope[:, None], (t, heads, c.qk_rope_head_dim))], -1)
    query = np.concatenate([q[..., :nope], rope(q[..., nope:])], -1)
    scores = np.einsum("thd,shd->hts", query, keys) * c.query_scale
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("hts,shd->thd", probs / probs.sum(-1, keepdims=True), kv[..., nope:])
    return out.reshape(t, -1) @ w("o_proj").T


@pytest.mark.parametrize("name", list(SHAPES))
def test_absorbed_attention_equals_the_expanded_one(name: str, ref: Backend) -> None:
    """A layer's absorbed MLA (queries in latent space, MQA over the cached rows, the latent output
    up-projected) equals transformers' expanded form on random inputs, prefill and then decode."""
    loaded = load_model(FIXTURES / name)
    loaded_weights = dict(loaded.weights)
    model = DecoderModel(loaded, ref)
    attn = model.weights.layers[1].mixer
    assert isinstance(attn, LatentAttention)
    kv = model.allocate_kv_cache(2, 16, "f32")
    x = np.random.default_rng(0).standard_normal((12, model.config.hidden_size)).astype(np.float32)
    expected = _expanded_attention(loaded_weights, "layers.1.", x.astype(np.float64), model.config)
    got = []
    for start, stop in ((0, 9), (9, 10), (10, 11), (11, 12)):  # a prompt, then one token per step
        pos = np.arange(start, stop, dtype=np.int32)
        batch = ForwardBatch(pos.copy(), pos, np.zeros_like(pos), pos.copy(), np.array([[0, 1]], np.int32),
                             np.arange(stop - start, dtype=np.int32))
        step = StepTensors.upload(ref, batch)
        ids = model.head_ids(stop - start)
        got.append(model.latent_attention(attn, ref.upload(x[start:stop], "f32"), step, kv, 1, ids).numpy())
    diff = np.abs(np.concatenate(got) - expected).max()
    assert diff <= 1e-5 * np.abs(expected).max(), diff


def _edited(tmp_path: Path, name: str, **fields: object) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | fields))
    return out


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"kv_lora_rank": None}, ModelFormatError, "kv_lora_rank must be a positive integer"),
    ({"qk_rope_head_dim": 7}, ModelFormatError, "qk_rope_head_dim is 7"),
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias"),
    ({"mlp_layer_types": ["dense", "sparse"]}, ModelFormatError, "mlp_layer_types must list"),
])
def test_bad_mla_config_is_one_line(tmp_path: Path, fields: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as exc:
        load_model(_edited(tmp_path, "tiny_glm4_moe_lite", **fields))
    assert "\n" not in str(exc.value)


def test_mla_config_is_read_alike_from_both_formats() -> None:
    """The converted GGUF's deepseek2 keys (kv_lora_rank, key_length_mla, YaRN's log multiplier as
    0.1 mscale_all_dim) give the HF fixture's config: the row width, the rope dims, the scale."""
    hf, gguf = (load_model(FIXTURES / n).config for n in ("tiny_deepseek_v3", "tiny_deepseek_v3_gguf/model.gguf"))
    fields = ("num_kv_heads", "head_dim", "rotary_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "rope_interleaved", "moe_groups", "moe_top_groups")
    assert [getattr(hf, f) for f in fields] == [getattr(gguf, f) for f in fields] == \
        [1, 40, 8, 24, 32, 16, 8, 16, True, 2, 1]
    mscale = 0.1 * 0.707 * np.log(4.0) + 1.0  # transformers' softmax scale: 1 / sqrt(24) x mscale^2
    assert hf.query_scale == pytest.approx(24 ** -0.5 * mscale ** 2, rel=1e-12)
    assert gguf.query_scale == pytest.approx(hf.query_scale, rel=1e-6)
    assert [layer.moe for layer in hf.layers] == [layer.moe for layer in gguf.layers] == [False, True, True]


def test_long_prompt_runs_alike_on_both_backends(ref: Backend, vk_default: Backend) -> None:
    """A prompt longer than the steps whose per-head ids are kept (HEAD_IDS_KEPT) uploads its own,
    on both backends alike; decode after it reuses the kept ones."""
    from tests.models.conftest import Greedy
    from vkrt.models.decoder import HEAD_IDS_KEPT

    prompt = [(11 * i + 3) % 256 for i in range(HEAD_IDS_KEPT + 16)]
    runs = [Greedy(DecoderModel(load_model(FIXTURES / "tiny_deepseek_v3"), b), max_len=112).generate(prompt, 8)
            for b in (ref, vk_default)]
    assert runs[0] == runs[1]


# A replayed decode step of one sequence (engine): embedding, 3 layers, final norm + head, sample.
# An MLA layer's attention is 9 dispatches with the q LoRA (8 without): q_a (the layer's norm
# folded), q_b (q_a's norm folded), kv_a (the layer's norm folded), the cache write
# (latent_kv_write: the latent's norm and the key's rope with it; 13 and 12 when they were four
# dispatches, kv_a split in two), the query absorption, the query's rope, attention, the value
# up-projection, o_proj with the residual. Its MLPs are GLM-4.5's (dense: 2;
# sparse: 9 with the shared expert).
DECODE_DISPATCHES = {"tiny_deepseek_v3": 51, "tiny_glm4_moe_lite": 48}


@pytest.mark.parametrize("name", list(DECODE_DISPATCHES))
def test_decode_step_dispatches(name: str, vk_default: Backend) -> None:
    from collections import Counter

    from tests.models.conftest import Greedy
    from vkrt.engine import LLM, SamplingParams

    prompt = json.loads((FIXTURES / name / "golden.json").read_text())["cases"][-1]["input_ids"]
    driver = Greedy(DecoderModel(load_model(FIXTURES / name), vk_default), max_len=64)
    driver.step(prompt, 0)
    before = Counter(vk_default.selections)
    driver.step([1], len(prompt))
    ran: Counter[str] = Counter()
    for (op, kernel), n in vk_default.selections.items():
        ran[op] += n - before[(op, kernel)]
    layers = 3
    assert (ran["moe_matmul"], ran["latent_kv_write"], ran["rope"], ran["paged_attention"], ran["kv_write"],
            ran["concat_columns"]) == (2 * layers + 2, layers, layers, layers, 0, 0)  # (+ 2 sparse layers' downs)
    llm = LLM(FIXTURES / name, device="vulkan", max_model_len=64, max_num_seqs=1)
    llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    worst = stats["decode_counters_max"]
    assert stats["decode_steps"] >= 5 and stats["last_step"]["replayed"]
    assert (worst["dispatches"], worst["submits"], worst["fence_waits"], worst["drains"]) == \
        (DECODE_DISPATCHES[name], 1, 1, 0)


@pytest.mark.parametrize("name", list(SHAPES))
def test_mtp_layers_are_skipped(tmp_path: Path, name: str) -> None:
    """A checkpoint's multi-token-prediction layer after the main ones (num_nextn_predict_layers, as
    DeepSeek-V3's and GLM-4.7-Flash's configs have it) is skipped: the model is the main layers."""
    from safetensors.numpy import load_file, save_file

    saved = load_model(FIXTURES / name)
    d = _edited(tmp_path, name, num_nextn_predict_layers=1)
    tensors = load_file(str(d / "model.safetensors"))
    mtp = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # (one of the MTP layer's own)
    save_file(tensors | mtp, str(d / "model.safetensors"))
    loaded = load_model(d)
    assert loaded.config == saved.config and loaded.weights.keys() == saved.weights.keys()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 0}))
    with pytest.raises(UnsupportedModelError, match="eh_proj"):  # uncounted, the extra layer is an error
        load_model(d)


def test_absorbed_weights_keep_a_16_bit_source_format(tmp_path: Path, ref: Backend, vk_default: Backend) -> None:
    """From an f16 checkpoint the absorbed query and value matrices are f16 (exact: zeros, ones and
    the checkpoint's own values), half of f32's memory; both backends still decode alike."""
    from safetensors.numpy import load_file, save_file

    from tests.models.conftest import Greedy

    d = tmp_path / "f16"
    shutil.copytree(FIXTURES / "tiny_deepseek_v3", d)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v.astype(np.float16) for k, v in tensors.items()}, str(d / "model.safetensors"))
    model = DecoderModel(load_model(d), ref)
    attn = model.weights.layers[0].mixer
    assert isinstance(attn, LatentAttention) and attn.q_absorb.dtype == attn.v_up.dtype == "f16"
    prompt = json.loads((FIXTURES / "tiny_deepseek_v3" / "golden.json").read_text())["cases"][-1]["input_ids"]
    runs = [Greedy(DecoderModel(load_model(d), b), max_len=64).generate(prompt, 8) for b in (ref, vk_default)]
    assert runs[0] == runs[1]
