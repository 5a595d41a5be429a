"""A step the device cannot run: VK_ERROR_DEVICE_LOST ends every request with finish_reason
"error" and the engine runs nothing more; out of device memory ends the step's requests and
the engine goes on serving, with no prefix-cache entry left on a block the step did not fill.
On the numpy reference path through a faulty fake model, and on the Vulkan device through
the result codes its submit and fence wait return (tests/device_faults.py)."""

from __future__ import annotations

import json

import pytest
from engine_fakes import FakeLM, FaultyLM, byte_tokenizer

from tests.conftest import FIXTURES
from tests.device_faults import (
    VK_ERROR_DEVICE_LOST,
    VK_ERROR_OUT_OF_DEVICE_MEMORY,
    inject,
    refuse_allocation,
)
from vkrt.backend.base import Backend
from vkrt.engine import LLM, SamplingParams
from vkrt.errors import DeviceLostError, OutOfDeviceMemory

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _llm(model: FakeLM, **kwargs: object) -> LLM:
    return LLM(model=model, tokenizer=byte_tokenizer(), device="reference", max_model_len=128, kv_dtype="f32",
               **kwargs)


def test_device_lost_ends_every_request_and_the_engine() -> None:
    model = FaultyLM(DeviceLostError("vkQueueSubmit returned VK_ERROR_DEVICE_LOST"), nth=3)
    llm = _llm(model)
    prompts = [list(b"hello"), list(b"hi")]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "error" and "VK_ERROR_DEVICE_LOST" in (out.outputs[0].error or "")
        assert out.outputs[0].token_ids == FakeLM().reference_greedy(prompt, 2)  # the two steps that ran
    assert isinstance(llm.engine.device_lost, DeviceLostError)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    # Nothing runs any more: a later request ends at once, with the same reason.
    later = llm.generate(list(b"again"), GREEDY)[0]
    assert later.finish_reason == "error" and "VK_ERROR_DEVICE_LOST" in (later.outputs[0].error or "")
    assert model.forwards == 3


def test_out_of_memory_ends_the_step_and_the_engine_goes_on() -> None:
    model = FaultyLM(OutOfDeviceMemory("vkQueueSubmit ran out of device memory"), nth=2)
    llm = _llm(model, max_num_seqs=1)  # one request per step: the second waits while the first fails
    first, second = llm.generate([list(b"hello"), list(b"world")], GREEDY)
    assert first.finish_reason == "error" and "out of device memory" in (first.outputs[0].error or "")
    assert first.outputs[0].token_ids == FakeLM().reference_greedy(list(b"hello"), 1)
    assert second.finish_reason == "length" and second.outputs[0].error is None
    assert second.outputs[0].token_ids == FakeLM().reference_greedy(list(b"world"), 6)
    assert llm.engine.device_lost is None
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_failed_prefill_leaves_no_prefix_cache_hit_on_its_blocks() -> None:
    """Full blocks enter the prefix cache when they are allocated, before the step fills them:
    a refused step must take them out again, or the same prompt would read K/V never written."""
    prompt = list(b"a prompt long enough to fill several blocks")
    llm = _llm(FaultyLM(OutOfDeviceMemory("refused"), nth=1), block_size=4)
    assert llm.generate(prompt, GREEDY)[0].finish_reason == "error"
    again = llm.generate(prompt, GREEDY)[0]
    assert again.outputs[0].token_ids == FakeLM().reference_greedy(prompt, 6)
    assert llm.engine.block_manager.prefix_hits == 0


@pytest.fixture
def tiny_llama(vk_default: Backend) -> tuple[LLM, dict]:
    golden = json.loads((FIXTURES / "tiny_llama" / "golden.json").read_text())
    llm = LLM(FIXTURES / "tiny_llama", device="vulkan", max_model_len=64, max_num_seqs=2, kv_dtype="f32")
    return llm, golden["cases"][1]


def _params(case: dict) -> SamplingParams:
    return SamplingParams(max_tokens=len(case["greedy_ids"]), temperature=0.0, ignore_eos=True)


def test_vulkan_out_of_memory_in_a_submit_fails_the_request_and_the_next_one_is_exact(
        tiny_llama: tuple[LLM, dict], vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    llm, case = tiny_llama
    assert llm.generate([case["input_ids"]], _params(case))[0].token_ids == case["greedy_ids"]  # records the step
    hook = inject(monkeypatch, vk_default, "vkQueueSubmit", VK_ERROR_OUT_OF_DEVICE_MEMORY, nth=3)
    failed = llm.generate([case["input_ids"]], _params(case))[0]
    assert hook.failed == 1
    assert failed.finish_reason == "error" and "vkQueueSubmit ran out of device memory" in failed.outputs[0].error
    assert failed.token_ids == case["greedy_ids"][:len(failed.token_ids)] and len(failed.token_ids) < 16
    assert llm.generate([case["input_ids"]], _params(case))[0].token_ids == case["greedy_ids"]
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_vulkan_allocation_refused_mid_prefill_discards_the_step(
        tiny_llama: tuple[LLM, dict], vk_default: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill runs eagerly: the refusal comes with part of its forward recorded into the open
    batch, which must not run with the next step (it would write K/V into blocks given to others)."""
    llm, case = tiny_llama
    asked = refuse_allocation(monkeypatch, vk_default, nth=5)
    failed = llm.generate([case["input_ids"]], _params(case))[0]
    assert len(asked) >= 5 and failed.finish_reason == "error" and failed.token_ids == []
    assert "cannot allocate" in failed.outputs[0].error and "for activations" in failed.outputs[0].error
    batch = vk_default.batch  # type: ignore[attr-defined]
    assert batch.recorded == 0 and not batch.recording  # the partial forward was dropped, not left open
    assert llm.generate([case["input_ids"]], _params(case))[0].token_ids == case["greedy_ids"]


@pytest.mark.parametrize("call", ["vkQueueSubmit", "vkWaitForFences"])
def test_vulkan_device_lost_ends_every_request(tiny_llama: tuple[LLM, dict], vk_default: Backend,
                                               monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    llm, case = tiny_llama
    inject(monkeypatch, vk_default, call, VK_ERROR_DEVICE_LOST, nth=4)
    outs = llm.generate([case["input_ids"], case["input_ids"][:3]], _params(case))
    for out in outs:
        assert out.finish_reason == "error", out
        assert f"{call} returned VK_ERROR_DEVICE_LOST" in (out.outputs[0].error or "")
    assert isinstance(llm.engine.device_lost, DeviceLostError)
    assert llm.generate([case["input_ids"]], _params(case))[0].finish_reason == "error"
