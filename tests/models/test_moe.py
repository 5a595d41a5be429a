"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) through the generic decoder.

The fixtures are tiny random-weight models made by transformers' own classes
(tools/make_fixtures.py --only moe, tests/fixtures/README.md); tiny_qwen3_moe_gguf is a
GGUF written with the gguf package and its golden is transformers' forward of that file.
Bound: max |logit - golden| <= 2e-4 on the reference backend, as for the dense families
(measured <= 1.3e-5, most of it the goldens' 6-digit rounding); greedy ids equal (the
smallest greedy margin in these goldens is 0.0011, tiny_qwen2_moe's, above twice the
bound). On Vulkan every MoE op is native (routing, expert matmuls and combine never leave
the device): no step drains, and the engine's decode steps replay with one submit and one
fence wait.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.conftest import FIXTURES
from tests.models.conftest import Greedy
from vkrt.backend.base import Backend
from vkrt.errors import ModelFormatError, VkrtError
from vkrt.loader import load_model
from vkrt.models import build_model
from vkrt.models.weights import Experts

# *_gguf: the HF fixture through llama.cpp's converter (tiny_qwen3_moe_gguf: the gguf package's writer)
MOE = ["tiny_qwen3_moe", "tiny_qwen3_moe_gguf", "tiny_mixtral", "tiny_mixtral_gguf", "tiny_olmoe", "tiny_olmoe_gguf",
       "tiny_qwen2_moe", "tiny_minimax_m2", "tiny_minimax_m2_gguf"]
LOGIT_ATOL = 2e-4
MAX_LEN = 64


def _golden(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden.json").read_text())


def _model_path(name: str) -> Path:
    """The fixture's HF directory, or its GGUF file (`meta.model_file`)."""
    return FIXTURES / name / _golden(name)["meta"].get("model_file", "")


def _logits_within(model, golden: str) -> None:
    for case in _golden(golden)["cases"]:
        logits = Greedy(model, max_len=MAX_LEN).step(case["input_ids"], 0, all_logits=True)
        want = np.array(case["all_logits"], np.float32)
        assert logits.shape == want.shape
        diff = float(np.abs(logits - want).max())
        assert diff <= LOGIT_ATOL, f"{golden} len {len(case['input_ids'])}: max |diff| {diff}"


@pytest.mark.parametrize("name", MOE)
def test_logits_and_greedy_ids_match_transformers(name: str, ref: Backend) -> None:
    model = build_model(load_model(_model_path(name)), ref)
    _logits_within(model, name)
    for case in _golden(name)["cases"]:
        got = Greedy(model, max_len=MAX_LEN).generate(case["input_ids"], len(case["greedy_ids"]))
        assert got == case["greedy_ids"], f"{name} len {len(case['input_ids'])}"


def test_configs() -> None:
    qwen = load_model(FIXTURES / "tiny_qwen3_moe").config
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 16)
    assert qwen.norm_topk_prob and qwen.qk_norm and qwen.qk_norm_per_head
    assert [layer.moe for layer in qwen.layers] == [False, True]  # mlp_only_layers [0]
    mixtral = load_model(FIXTURES / "tiny_mixtral").config
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 32)
    assert mixtral.norm_topk_prob and not mixtral.qk_norm
    assert [(layer.moe, layer.window) for layer in mixtral.layers] == [(True, 8), (True, 8)]
    gguf_cfg = load_model(_model_path("tiny_qwen3_moe_gguf")).config  # llama.cpp: every layer has a router
    assert [layer.moe for layer in gguf_cfg.layers] == [True, True] and gguf_cfg.norm_topk_prob
    assert (gguf_cfg.num_experts, gguf_cfg.num_experts_per_tok, gguf_cfg.moe_intermediate_size) == (8, 2, 16)
    olmoe = load_model(FIXTURES / "tiny_olmoe").config
    assert (olmoe.num_experts, olmoe.num_experts_per_tok) == (5, 3)
    assert not olmoe.norm_topk_prob and olmoe.qk_norm and not olmoe.qk_norm_per_head
    # llama.cpp writes Mixtral as "llama" with an expert count and no window; OLMoE as "olmoe"
    mixtral_gguf = load_model(_model_path("tiny_mixtral_gguf")).config
    assert mixtral_gguf.architecture == "mixtral" and mixtral_gguf.norm_topk_prob
    assert [(layer.moe, layer.window) for layer in mixtral_gguf.layers] == [(True, 0), (True, 0)]
    assert (mixtral_gguf.num_experts, mixtral_gguf.num_experts_per_tok, mixtral_gguf.moe_intermediate_size) == (4, 2, 32)
    olmoe_gguf = load_model(_model_path("tiny_olmoe_gguf")).config
    assert (olmoe_gguf.num_experts, olmoe_gguf.num_experts_per_tok, olmoe_gguf.layers) == (5, 3, olmoe.layers)
    assert not olmoe_gguf.norm_topk_prob and not olmoe_gguf.qk_norm_per_head
    qwen2 = load_model(FIXTURES / "tiny_qwen2_moe").config
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.moe_intermediate_size) == (7, 2, 16)
    assert qwen2.shared_expert_intermediate_size == 48 and qwen2.qkv_bias and not qwen2.norm_topk_prob
    assert qwen.shared_expert_intermediate_size == 0 == mixtral.shared_expert_intermediate_size


@pytest.mark.parametrize("name", MOE)
def test_vulkan_equals_reference_token_for_token(name: str, ref: Backend, vk_default: Backend) -> None:
    """Greedy ids of both backends on the longest prompt, and the goldens' logits on Vulkan;
    no Vulkan step (prefill or decode) drains."""
    case = _golden(name)["cases"][-1]
    runs = []
    for backend in (ref, vk_default):
        driver = Greedy(build_model(load_model(_model_path(name)), backend), max_len=MAX_LEN)
        runs.append(driver.generate(case["input_ids"], len(case["greedy_ids"])))
        if backend is vk_default:
            assert {c["drains"] for c in driver.step_counters} == {0}
    assert runs[0] == runs[1] == case["greedy_ids"]
    _logits_within(build_model(load_model(_model_path(name)), vk_default), name)


@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_engine_concurrent_greedy_requests_equal_the_goldens(device: str, request: pytest.FixtureRequest) -> None:
    """Three requests decoded together through the engine give transformers' solo greedy ids."""
    from vkrt.engine import LLM, SamplingParams

    request.getfixturevalue("ref" if device == "reference" else "vk_default")
    cases = _golden("tiny_mixtral")["cases"][1:]
    llm = LLM(FIXTURES / "tiny_mixtral", device=device, max_model_len=MAX_LEN, max_num_seqs=4)
    outputs = llm.generate([c["input_ids"] for c in cases],
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [c["greedy_ids"] for c in cases]
    if device == "vulkan":  # decode steps are recorded once per bucket and replayed
        stats = llm.stats()
        worst = stats["decode_counters_max"]
        assert stats["decode_steps"] >= 15 and stats["last_step"]["replayed"]
        assert (worst["submits"], worst["fence_waits"], worst["drains"]) == (1, 1, 0)


# A replayed decode step of one sequence (engine): embedding, the layers, final norm + head,
# sample. A sparse layer's MLP is 7 dispatches: norm, router matmul (norm folded), route, gate|up
# with the SwiGLU gate (moe_matmul_gated), down, combine, residual add; before the gate was
# folded into the expert matmul it was 8 (21, 26, 24, 38 were 22, 28, 26, 40). Qwen2-MoE's
# shared expert adds three: its gate|up with SwiGLU, its down, its gate logit (the combine
# takes the shared term: moe_combine_shared). MiniMax-M2 counts as OLMoE (QK-norm over all of q
# and of k): its sigmoid router with the bias is one routing dispatch, as the softmax one is.
DECODE_DISPATCHES = {"tiny_qwen3_moe": 21, "tiny_qwen3_moe_gguf": 26, "tiny_mixtral": 24, "tiny_mixtral_gguf": 24,
                     "tiny_olmoe": 38, "tiny_olmoe_gguf": 38, "tiny_qwen2_moe": 32, "tiny_minimax_m2": 38,
                     "tiny_minimax_m2_gguf": 38}


@pytest.mark.parametrize("name", MOE)
def test_decode_step_dispatches(name: str, vk_default: Backend) -> None:
    """Each sparse layer runs one gated expert matmul and one down expert matmul and no
    separate activation; the engine's decode step replays in 1 submit, 1 fence wait, 0 drains."""
    from collections import Counter

    from vkrt.engine import LLM, SamplingParams

    case = _golden(name)["cases"][-1]
    model = build_model(load_model(_model_path(name)), vk_default)
    driver = Greedy(model, max_len=MAX_LEN)
    driver.step(case["input_ids"], 0)
    before = Counter(vk_default.selections)
    driver.step(case["greedy_ids"][:1], len(case["input_ids"]))
    ran: Counter[str] = Counter()
    for (op, kernel), n in vk_default.selections.items():
        ran[op] += n - before[(op, kernel)]
    sparse = sum(layer.moe for layer in model.config.layers)
    assert (ran["moe_matmul_gated"], ran["moe_matmul"], ran["silu_and_mul"]) == (sparse, sparse, 0)
    llm = LLM(_model_path(name), device="vulkan", max_model_len=MAX_LEN, max_num_seqs=1)
    llm.generate([case["input_ids"]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    worst = stats["decode_counters_max"]
    assert stats["decode_steps"] >= 5 and stats["last_step"]["replayed"]
    assert (worst["dispatches"], worst["submits"], worst["fence_waits"], worst["drains"]) == \
        (DECODE_DISPATCHES[name], 1, 1, 0)


# -- GGUF -------------------------------------------------------------------------------------

_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _moe_gguf_tensors(fixture: str = "tiny_qwen3_moe") -> dict[str, np.ndarray]:
    """An HF MoE fixture's tensors as llama.cpp names them: each layer's experts stacked [E, out, in]."""
    from safetensors.numpy import load_file

    hf = load_file(str(FIXTURES / fixture / "model.safetensors"))
    cfg = json.loads((FIXTURES / fixture / "config.json").read_text())
    out = {"token_embd.weight": hf.pop("model.embed_tokens.weight"), "output_norm.weight": hf.pop("model.norm.weight")}
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" in hf:
            for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                out[f"blk.{i}.{name}.weight"] = np.stack([hf.pop(f"{p}{e}.{proj}.weight") for e in range(experts)])
    for name, value in hf.items():
        parts = name.split(".")
        out[f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"] = value
    return out


def _write_moe_gguf(path: Path, tensors: dict[str, np.ndarray], fixture: str = "tiny_qwen3_moe",
                          arch: str = "qwen3moe", **overrides: int) -> None:
    cfg = json.loads((FIXTURES / fixture / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_expert_count(overrides.get("experts", cfg.get("num_local_experts", cfg.get("num_experts"))))
    w.add_expert_used_count(overrides.get("used", cfg["num_experts_per_tok"]))
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    for name, value in tensors.items():
        if value.dtype == np.uint8:  # Q8_0 blocks
            w.add_tensor(name, value, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:  # F16 where the array is float16, else F32
            w.add_tensor(name, np.ascontiguousarray(value, np.float16 if value.dtype == np.float16 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_moe_gguf_reproduces_the_hf_golden(tmp_path: Path, ref: Backend) -> None:
    """llama.cpp's layout (3-D ffn_*_exps, ffn_gate_inp; a layer without a router is dense)
    gives transformers' golden of the same weights."""
    path = tmp_path / "qwen3moe.gguf"
    _write_moe_gguf(path, _moe_gguf_tensors())
    loaded = load_model(path)
    assert [layer.moe for layer in loaded.config.layers] == [False, True]
    assert loaded.weights["layers.1.experts.up_proj"].shape == (8, 16, 64)
    _logits_within(build_model(loaded, ref), "tiny_qwen3_moe")


def test_qwen2_moe_gguf_reproduces_the_hf_golden(tmp_path: Path, ref: Backend) -> None:
    """llama.cpp's qwen2moe names (ffn_*_shexp, ffn_gate_inp_shexp, expert_shared_feed_forward_length)
    give transformers' golden of the same weights."""
    path = tmp_path / "qwen2moe.gguf"
    _write_moe_gguf(path, _moe_gguf_tensors("tiny_qwen2_moe"), "tiny_qwen2_moe", "qwen2moe")
    loaded = load_model(path)
    assert loaded.config.architecture == "qwen2_moe" and loaded.config.shared_expert_intermediate_size == 48
    assert loaded.weights["layers.1.shared_expert_gate"].shape == (1, 64)
    _logits_within(build_model(loaded, ref), "tiny_qwen2_moe")


@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_quantized_experts_stay_quantized(tmp_path: Path, device: str, request: pytest.FixtureRequest) -> None:
    """Q8_0 gate/up expert tensors load as Q8_0 [E, out, in] and compute what their values
    (dequantized by the gguf package) compute as F32 experts, on each backend (on Vulkan
    natively, 0 drains). (down's rows of 16 values are not whole Q8_0 blocks: it stays F32.)"""
    backend: Backend = request.getfixturevalue("ref" if device == "reference" else "vk_default")
    from gguf.quants import dequantize, quantize

    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors, dequantized = _moe_gguf_tensors(), _moe_gguf_tensors()
    for name in [n for n in tensors if n.endswith(("gate_exps.weight", "up_exps.weight"))]:
        tensors[name] = quantize(tensors[name], q8)
        dequantized[name] = dequantize(tensors[name], q8)
    _write_moe_gguf(tmp_path / "q8.gguf", tensors)
    _write_moe_gguf(tmp_path / "f32.gguf", dequantized)
    q8_model = load_model(tmp_path / "q8.gguf")
    assert q8_model.weights["layers.1.experts.gate_proj"].fmt == "q8_0"
    case = _golden("tiny_qwen3_moe")["cases"][-1]
    drivers = [Greedy(build_model(m, backend), max_len=MAX_LEN) for m in (q8_model, load_model(tmp_path / "f32.gguf"))]
    logits = [d.step(case["input_ids"], 0, all_logits=True) for d in drivers]
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-5)
    assert drivers[0].step_counters[0]["drains"] == 0


@pytest.mark.parametrize("device", ["reference", "vulkan"])
def test_gate_and_up_experts_in_different_formats_stay_apart(tmp_path: Path, device: str,
                                                               request: pytest.FixtureRequest) -> None:
    """A GGUF whose gate and up expert stacks differ in format keeps each in its own (they are
    not dequantized to stack them): two expert matmuls whose outputs sit side by side, meaning
    exactly what one stacked gate|up of the same numbers means; natively, 0 drains."""
    backend: Backend = request.getfixturevalue("ref" if device == "reference" else "vk_default")
    tensors, same = _moe_gguf_tensors(), _moe_gguf_tensors()
    for name in [n for n in tensors if n.endswith("gate_exps.weight")]:
        tensors[name] = tensors[name].astype(np.float16)
        same[name] = tensors[name].astype(np.float32)  # the same numbers, stored as f32
    _write_moe_gguf(tmp_path / "mixed.gguf", tensors)
    _write_moe_gguf(tmp_path / "f32.gguf", same)
    mixed, stacked = (build_model(load_model(tmp_path / name), backend) for name in ("mixed.gguf", "f32.gguf"))
    sparse = [layer.mlp for layer in mixed.weights.layers if isinstance(layer.mlp, Experts)]  # type: ignore[attr-defined]
    assert sparse and all([w.dtype for w in e.gate_up] == ["f16", "f32"] for e in sparse)
    assert all(len(layer.mlp.gate_up) == 1 for layer in stacked.weights.layers  # type: ignore[attr-defined]
               if isinstance(layer.mlp, Experts))
    case = _golden("tiny_qwen3_moe")["cases"][-1]
    drivers = [Greedy(m, max_len=MAX_LEN) for m in (mixed, stacked)]
    logits = [d.step(case["input_ids"], 0, all_logits=True) for d in drivers]
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-5)
    assert drivers[0].step_counters[0]["drains"] == 0


def test_hf_experts_of_one_projection_in_different_formats_are_refused(tmp_path: Path, ref: Backend) -> None:
    """HF's one tensor per expert: experts of one projection in different dtypes cannot form
    one stacked weight, so the build names the odd tensor (it is not silently dequantized)."""
    from safetensors.numpy import load_file, save_file

    d = _hf_copy(tmp_path)
    weights = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    weights[name] = weights[name].astype(np.float16)
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(VkrtError) as exc:
        build_model(load_model(d), ref)
    _one_line(exc, "layers.1.experts.3.up_proj is f16", "share a storage format")


# -- bad input: one line naming the tensor ----------------------------------------------------

def _one_line(exc: pytest.ExceptionInfo[VkrtError], *needles: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_gguf_with_fewer_experts_in_one_tensor(tmp_path: Path) -> None:
    tensors = _moe_gguf_tensors()
    tensors["blk.1.ffn_up_exps.weight"] = tensors["blk.1.ffn_up_exps.weight"][:7]
    path = tmp_path / "seven.gguf"
    _write_moe_gguf(path, tensors)
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "seven.gguf", "layers.1.experts.up_proj", "(7, 16, 64)", "(8, 16, 64)")


def test_gguf_expert_count_disagrees_with_router(tmp_path: Path) -> None:
    path = tmp_path / "count.gguf"
    _write_moe_gguf(path, _moe_gguf_tensors(), experts=6)
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "count.gguf", "layers.1.router", "(8, 64)", "(6, 64)")


@pytest.mark.parametrize(("experts", "used", "needle"), [(8, 9, "qwen3moe.expert_used_count"),
                                                         ((1 << 32) - 1, 2, "qwen3moe.expert_count must be")])
def test_gguf_bad_expert_counts(tmp_path: Path, experts: int, used: int, needle: str) -> None:
    """k above E, and an expert count no model has (refused before any loop over experts),
    each naming the metadata key as the file spells it."""
    path = tmp_path / "bad.gguf"
    _write_moe_gguf(path, _moe_gguf_tensors(), experts=experts, used=used)
    with pytest.raises(ModelFormatError) as exc:
        load_model(path)
    _one_line(exc, "bad.gguf", needle)


def _hf_copy(tmp_path: Path, name: str = "tiny_qwen3_moe") -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


def _edit_tensors(d: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def test_hf_missing_expert(tmp_path: Path) -> None:
    d = _hf_copy(tmp_path)
    _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, str(d), "layers.1.experts.3.up_proj", "missing")


def test_hf_missing_shared_expert_gate(tmp_path: Path) -> None:
    d = _hf_copy(tmp_path, "tiny_qwen2_moe")
    _edit_tensors(d, lambda t: t.pop("model.layers.0.mlp.shared_expert_gate.weight"))
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, str(d), "layers.0.shared_expert_gate", "missing")


def test_hf_expert_of_another_shape(tmp_path: Path) -> None:
    d = _hf_copy(tmp_path, "tiny_mixtral")

    def shrink(t: dict[str, np.ndarray]) -> None:
        t["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = np.zeros((64, 16), np.float32)

    _edit_tensors(d, shrink)
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, str(d), "layers.0.experts.2.down_proj", "(64, 16)", "(64, 32)")


def test_hf_more_experts_than_the_config(tmp_path: Path) -> None:
    d = _hf_copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_local_experts"]  # transformers 5 writes this alias; Qwen's own configs say num_experts
    cfg["num_experts"] = 7
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError) as exc:
        load_model(d)
    _one_line(exc, str(d), "layers.1.experts.7.", "beyond", "7 experts")


# -- experts that do not fit the device: OutOfDeviceMemory naming the expert tensor ------------

def _device_mib(backend: Backend, fmt: str, shape: tuple[int, ...]) -> str:
    return f"{backend.weight_nbytes(fmt, shape) / (1 << 20):.2f} MiB"


def test_experts_beyond_the_heap_are_named(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A heap that cannot hold the weights: the error says how much of them the experts are
    and names the largest expert tensor with its size; nothing is allocated."""
    from vkrt.errors import OutOfDeviceMemory

    memory = vk_default.memory  # type: ignore[attr-defined]
    monkeypatch.setattr(memory, "_heaps", [memory.reserved + (64 << 10)])
    before = vk_default.memory_stats()  # type: ignore[attr-defined]
    with pytest.raises(OutOfDeviceMemory) as exc:
        build_model(load_model(FIXTURES / "tiny_mixtral"), vk_default)
    _one_line(exc, "tiny_mixtral", "4 stacked expert tensors", "layers.1.experts.gate_up_proj", "f32 [4, 64, 64]",
              _device_mib(vk_default, "f32", (4, 64, 64)), "cannot allocate")
    assert exc.value.purpose == "weights"
    assert vk_default.memory_stats() == before  # type: ignore[attr-defined]


def test_an_expert_tensor_beyond_one_binding_is_named(vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """An expert weight the expert matmul could not bind whole (it would run on the host after
    a drain) is refused at upload, naming the tensor, its size and the device's limit."""
    from vkrt.errors import OutOfDeviceMemory

    caps = vk_default.caps  # type: ignore[attr-defined]
    size = vk_default.weight_nbytes("f32", (8, 32, 64))  # layers.1.experts.gate_up_proj of tiny_qwen3_moe
    monkeypatch.setattr(caps, "max_texel_elements", size // 8)
    monkeypatch.setattr(caps, "max_storage_range", size // 2)
    with pytest.raises(OutOfDeviceMemory) as exc:
        build_model(load_model(FIXTURES / "tiny_qwen3_moe"), vk_default)
    _one_line(exc, "tiny_qwen3_moe", "layers.1.experts.gate_up_proj", "f32 [8, 32, 64]",
              _device_mib(vk_default, "f32", (8, 32, 64)), "one buffer binding", caps.access_path)
