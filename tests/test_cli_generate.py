"""`vkrt generate` end to end (the README's first command, shortened), and how it reports
bad model input: one line naming the file and the problem, exit 1, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.conftest import FIXTURES

VKRT = [sys.executable, "-m", "vkrt.cli"]


def _run(*argv: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*VKRT, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_generate_smoke_on_the_default_model(smollm2_path: Path, vk_default) -> None:
    """What the README runs, with --max-tokens 8: text streams out, greedy and repeatable."""
    args = ("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--ignore-eos")
    first = _run(*args, "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    run = report["runs"][0]
    assert report["device"] == "vulkan"
    assert len(run["ids"]) == 8 and run["text"].strip()
    golden = json.loads((FIXTURES / "smollm2_golden.json").read_text())["text_prompts"][0]
    assert run["ids"] == golden["greedy_ids"][:8]  # transformers' greedy continuation
    streamed = _run(*args, "--stats")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() == run["text"].strip()
    assert "decode" in streamed.stderr and "drains" in streamed.stderr


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("vkrt: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _write_gguf(path: Path, arch: str = "llama", qtype: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_context_length(64)
    if qtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    else:
        raw = np.zeros((16, 32 // 32 * 22), np.uint8)  # Q5_0 blocks: 22 bytes per 32 values
        writer.add_tensor("token_embd.weight", raw, raw_shape=(16, 22), raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_missing_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    _assert_one_line_error(_run("generate", "hi", "--model", str(missing), "--device", "reference"),
                           str(missing), "no such file")


def test_truncated_gguf(tmp_path: Path, smollm2_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as src:
        cut.write_bytes(src.read(1 << 20))
    _assert_one_line_error(_run("generate", "hi", "--model", str(cut), "--device", "reference"), str(cut))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, arch="mamba")
    _assert_one_line_error(_run("generate", "hi", "--model", str(path), "--device", "reference"),
                           str(path), "mamba")


def test_unknown_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "q5.gguf"
    _write_gguf(path, qtype=int(gguf.GGMLQuantizationType.Q5_0))
    _assert_one_line_error(_run("generate", "hi", "--model", str(path), "--device", "reference"), str(path))


def test_hf_dir_without_config(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny_llama", model_dir)
    (model_dir / "config.json").unlink()
    _assert_one_line_error(_run("generate", "hi", "--model", str(model_dir), "--device", "reference"),
                           str(model_dir), "config.json")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = _run("--debug", "generate", "hi", "--model", str(tmp_path / "nope.gguf"), "--device", "reference")
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_bench_speculative_on_a_prompt_file(smollm2_path: Path, tmp_path: Path) -> None:
    """`vkrt bench --speculative-config ... --prompt-file F --json` reports the proposals, and
    each round's speculative decode against the same prompt decoded plainly in the same engine."""
    prompt = tmp_path / "copy.txt"
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    prompt.write_text(f"Here is some Python code.\n\n```python\n{code}```\n\nThe same code again:\n\n```python\n")
    result = _run("bench", "--gen-tokens", "16", "--prompt-file", str(prompt), "--json", "--no-warmup", "--repeat", "2",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    spec = report["speculative"]
    assert report["prompt_tokens"] > 30 and spec["num_drafts"] > 0
    assert 0.0 <= spec["acceptance_rate"] <= 1.0 and spec["mean_accepted_length"] >= 1.0
    plain, vs = report["plain"], report["vs_plain"]
    assert [run["generated_tokens"] for run in plain["runs"]] == [16, 16]
    assert vs["same_ids"] is True and len(vs["decode"]) == 2
    for ratio, run, peer in zip(vs["decode"], report["runs"], plain["runs"], strict=True):
        assert ratio == pytest.approx(run["decode_tok_s"] / peer["decode_tok_s"])
    assert vs["decode_median"] == pytest.approx(sum(vs["decode"]) / 2)
    assert [run["num_drafts"] for run in plain["runs"]] == [0, 0]  # the peer really did not speculate
    if spec["num_accepted_tokens"]:  # a step that made several tokens takes longer than a token
        assert report["per_step"]["step_ms"] > 1000 / report["decode_tok_s"]


def test_bench_constrained_to_a_json_schema(smollm2_path: Path, tmp_path: Path) -> None:
    """`vkrt bench --json-schema F`: the run ends where the schema's JSON does, before -g; a schema
    file that is not JSON is one line naming it."""
    schema = tmp_path / "digits.json"
    schema.write_text(json.dumps({"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 3}))
    result = _run("bench", "--gen-tokens", "48", "--prompt-tokens", "8", "--json", "--no-warmup",
                  "--json-schema", str(schema))
    assert result.returncode == 0, result.stderr
    [run] = json.loads(result.stdout)["runs"]
    assert 5 <= run["generated_tokens"] < 48  # "[1, 2, 3]" and the end, in a few tokens each
    schema.write_text("{ not json")
    _assert_one_line_error(_run("bench", "--json-schema", str(schema), "--device", "reference"), str(schema),
                           "is not JSON")


def test_bad_speculative_config_is_a_usage_error() -> None:
    result = _run("generate", "hi", "--speculative-config", '{"method": "ngram"}')
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "num_speculative_tokens must be an integer" in result.stderr
    result = _run("serve", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, "model": "d"}')
    assert result.returncode == 2 and "takes no model" in result.stderr
    result = _run("serve", "--speculative-config", '{"model": "d.gguf", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert result.returncode == 2 and "belong to method" in result.stderr


def test_a_draft_model_that_cannot_serve_is_a_clear_error(smollm2_path: Path) -> None:
    """A draft that is not there, or has another vocabulary: one line naming it, no traceback."""
    fixture = str(Path(__file__).parent / "fixtures" / "tiny_llama")
    for draft, says in (("no/such/draft.gguf", "no/such/draft.gguf"), (fixture, "its vocabulary has 256 tokens")):
        result = _run("generate", "hi", "--device", "reference", "--max-model-len", "64", "--speculative-config",
                      json.dumps({"model": draft, "num_speculative_tokens": 2}))
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert says in result.stderr, result.stderr


def test_chat_shows_a_harmony_reply_by_channel(capsys: pytest.CaptureFixture[str]) -> None:
    """`vkrt chat` with a harmony template: the final channel on stdout, the analysis on stderr,
    no markers in either, whatever the token boundaries (scripted outputs, no model)."""
    from types import SimpleNamespace

    from vkrt.cli_generate import ChatReading, _chat_reading, _run_once

    text = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Paris.")
    cuts = [0, 3, 12, 30, 41, 60, len(text)]
    outputs = [SimpleNamespace(text=text[a:b], token_ids=[1], finished=b == len(text), finish_reason="stop",
                               prompt_token_ids=[0]) for a, b in zip(cuts, cuts[1:], strict=False)]
    template = (FIXTURES / "chat_templates" / "gpt_oss.jinja").read_text(encoding="utf-8")
    llm = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template),
                          generate_stream=lambda prompt, params: iter(outputs))
    assert _chat_reading(SimpleNamespace(chat=True), llm, "") == ChatReading(None)
    assert _chat_reading(SimpleNamespace(chat=False), llm, None) is None
    run = _run_once(llm, [0], None, stream=True, reading=ChatReading(None))
    out, err = capsys.readouterr()
    assert (out, err) == ("Paris.\n", "Think.")
    assert run["text"] == text  # the JSON report keeps the raw output


def _scripted_llm(template: str, text: str, cuts: list[int]) -> Any:
    """An LLM stand-in whose stream gives `text` in the pieces `cuts` marks."""
    from types import SimpleNamespace

    bounds = [0, *cuts, len(text)]
    outputs = [SimpleNamespace(text=text[a:b], token_ids=[1], finished=b == len(text), finish_reason="stop",
                               prompt_token_ids=[0]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template),
                           generate_stream=lambda prompt, params: iter(outputs))


@pytest.mark.parametrize("template, opened", [
    ("qwen3.jinja", "<think>"), ("seed_oss.jinja", "<seed:think>"), ("mistral.jinja", None)])
@pytest.mark.parametrize("cuts", [[], [2, 9, 14, 23], list(range(1, 60))])
def test_chat_shows_a_thought_on_stderr_and_the_answer_on_stdout(template: str, opened: str | None,
                                                                 cuts: list[int],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`vkrt chat` with a template that knows think tags (Qwen3's <think>, Seed-OSS's
    <seed:think>): the thought goes to stderr, the answer to stdout, with no tag in either,
    however the stream is cut; a prompt that opens the thought itself leaves the reply inside
    it. A template without think tags shows the reply as written."""
    from types import SimpleNamespace

    from vkrt.cli_generate import _chat_reading, _run_once

    source = (FIXTURES / "chat_templates" / template).read_text(encoding="utf-8")
    chat = SimpleNamespace(chat=True)
    closing = opened.replace("<", "</") if opened else "</think>"
    text = f"{opened or '<think>'}Think.{closing}\n\nParis."
    llm = _scripted_llm(source, text, [c for c in cuts if c < len(text)])
    reading = _chat_reading(chat, llm, "<|im_start|>assistant\n")
    run = _run_once(llm, [0], None, stream=True, reading=reading)
    out, err = capsys.readouterr()
    assert (out, err) == ((text + "\n", "") if opened is None else ("Paris.\n", "Think."))
    assert run["text"] == text
    if opened is None:
        assert reading is None
        return
    inside = _chat_reading(chat, llm, f"<|im_start|>assistant\n{opened}\n")
    assert inside is not None and inside.inside and not reading.inside
    llm = _scripted_llm(source, text[len(opened):], [c for c in cuts if c < len(text) - len(opened)])
    _run_once(llm, [0], None, stream=True, reading=inside)
    assert capsys.readouterr() == ("Paris.\n", "Think.")
def test_bad_kv_events_config_is_a_usage_error() -> None:
    result = _run("serve", "--kv-events-config", '{"enable_kv_cache_events": true, "port": 5557}')
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown key(s) port; known: buffer_steps, enable_kv_cache_events, endpoint" in result.stderr


@pytest.mark.parametrize("error", ["lost", "oom"])
def test_a_device_fault_ends_generate_in_one_line(error: str, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The device fails in the second step (the fault hook: the runner raises the backend's typed error)."""
    from vkrt.cli import main
    from vkrt.engine.runner import ModelRunner
    from vkrt.errors import DeviceLostError, OutOfDeviceMemory

    fault = (DeviceLostError("vkQueueSubmit returned VK_ERROR_DEVICE_LOST: restart vkrt") if error == "lost"
             else OutOfDeviceMemory("vkQueueSubmit ran out of device memory (VkResult -2)"))
    execute, steps = ModelRunner.execute, []

    def failing(self: ModelRunner, *args: object, **kwargs: object) -> object:
        steps.append(1)
        if len(steps) == 2:
            raise fault
        return execute(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelRunner, "execute", failing)
    code = main(["generate", "hi", "-n", "4", "--model", str(smollm2_path), "--device", "reference"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vkrt: error:")]
    assert code == 1 and errors == [f"vkrt: error: {fault}"]


def test_chat_keeps_think_tags_that_are_special_tokens_in_the_text() -> None:
    """Seed-OSS's <seed:think> is a special token (in the fake vocabulary as in the model's):
    decoded with special tokens skipped the thought would run into the answer unmarked."""
    from tests.server.fake_engine import FakeTokenizer
    from vkrt.cli_generate import ChatReading
    from vkrt.engine.config import SamplingParams
    from vkrt.server.reasoning import SEED_THINK, THINK

    params = SamplingParams(max_tokens=4)
    assert not ChatReading(SEED_THINK).params(params, FakeTokenizer()).skip_special_tokens
    assert ChatReading(THINK).params(params, FakeTokenizer()) == params  # plain text in this vocabulary


def test_profile_phases_tell_verify_steps_from_decode_and_prefill() -> None:
    """bench --profile's tables: a step where every sequence ran one token is decode, a step that
    verified proposals without finishing a prompt is verify, anything else prefill."""
    from vkrt.cli_generate import _step_phase
    from vkrt.engine.engine import IterationStats
    from vkrt.engine.runner import StepStats

    def stats(tokens: int, seqs: int, prompt_tokens: int = 0, drafts: int = 0) -> IterationStats:
        it = IterationStats(StepStats(num_seqs=seqs, num_tokens=tokens), num_prompt_tokens=prompt_tokens)
        for _ in range(drafts):
            it.spec.record(3, 1)
        return it

    assert _step_phase(stats(2, 2)) == "decode"
    assert _step_phase(stats(8, 2, drafts=2)) == "verify"
    assert _step_phase(stats(5, 2, drafts=1)) == "verify"  # one sequence verifies, one decodes
    assert _step_phase(stats(40, 1)) == "prefill"
    assert _step_phase(stats(40, 2, prompt_tokens=36, drafts=1)) == "prefill"  # a prompt finished beside it
