"""Draft-model speculation on real kernels: tiny transformers fixtures and the default model.

The target's greedy ids must stay transformers' whatever the draft: the target itself (every
proposal accepted), tiny_llama cut to its first layer (a layer-skip draft built here from the
fixture's own weights: some proposals accepted), and another family's random model (next to
none accepted). The draft's steps replay, and no step drains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from tests.conftest import FIXTURES
from tests.server.live_model import test_device as device_for_tests
from vkrt.engine import LLM
from vkrt.engine.config import SamplingParams
from vkrt.engine.speculative import SpeculativeConfig
from vkrt.errors import VkrtError


def _cases(fixture: str) -> list[dict]:
    return json.loads((FIXTURES / fixture / "golden.json").read_text())["cases"]


@pytest.fixture(scope="module")
def first_layer_of_tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with only its first decoder layer: a draft that agrees with it now and then."""
    out = tmp_path_factory.mktemp("tiny_llama_1layer")
    config = json.loads((FIXTURES / "tiny_llama" / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(FIXTURES / "tiny_llama" / "model.safetensors")
    save_file({name: w for name, w in weights.items() if ".layers.1." not in name}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("target, draft, acceptance", [
    ("tiny_llama", "tiny_llama", (1.0, 1.0)),
    ("tiny_llama", "first_layer", (0.05, 0.9)),
    ("tiny_llama", "tiny_mistral", (0.0, 0.5)),
    ("tiny_gemma3", "tiny_gemma3", (1.0, 1.0)),  # sliding-window groups in both caches
])
def test_draft_proposals_keep_transformers_greedy_ids(target: str, draft: str, acceptance: tuple[float, float],
                                                     first_layer_of_tiny_llama: Path) -> None:
    cases = _cases(target)
    path = first_layer_of_tiny_llama if draft == "first_layer" else FIXTURES / draft
    spec = SpeculativeConfig("draft_model", 3, model=str(path))
    llm = LLM(FIXTURES / target, device=device_for_tests(), kv_dtype="f32", block_size=4, max_model_len=64,
              speculative=spec)
    n = len(cases[0]["greedy_ids"])
    outs = llm.generate([c["input_ids"] for c in cases], SamplingParams(max_tokens=n, temperature=0.0,
                                                                         ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [c["greedy_ids"] for c in cases]
    engine = llm.engine
    spec_stats = engine.totals.spec
    assert spec_stats.num_drafts > 0 and acceptance[0] <= spec_stats.acceptance_rate <= acceptance[1], spec_stats
    assert engine.totals.decode_counters_max["drains"] == 0
    drafter = engine.drafter
    assert drafter is not None
    if drafter.runner.replay:  # its decode steps were recorded and replayed
        assert drafter.runner._graphs and drafter.runner.last_step.replayed
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks  # the finished requests gave theirs back


def test_the_default_model_refuses_a_draft_with_another_vocabulary(smollm2_path: Path) -> None:
    spec = SpeculativeConfig("draft_model", 2, model=str(FIXTURES / "tiny_llama"))
    with pytest.raises(VkrtError, match="its vocabulary has 256 tokens, the target's 49152"):
        LLM(smollm2_path, device="reference", max_model_len=256, speculative=spec)


def test_the_default_model_as_its_own_draft_equals_plain_decoding(smollm2_path: Path) -> None:
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(smollm2_path, device=device_for_tests(), max_model_len=256, max_num_seqs=2)
    expected = plain.generate([prompt], params)[0].outputs[0].token_ids
    spec = SpeculativeConfig("draft_model", 3, model=str(smollm2_path))
    llm = LLM(smollm2_path, device=device_for_tests(), max_model_len=256, max_num_seqs=2, speculative=spec)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected
    # batch invariance: the draft's one-token steps give the logits the target's verify rows do
    assert llm.engine.totals.spec.acceptance_rate == 1.0, llm.engine.totals.spec
