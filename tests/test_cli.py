"""`vkrt devices`, `vkrt ops` (human and --json) and how the CLI reports errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vkrt.backend.base import Backend
from vkrt.cli import main
from vkrt.errors import VkrtError
from vkrt.ops import OPS


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_devices_json(vk_default: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "devices", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["vulkan"] is True
    assert [d["index"] for d in info["devices"]] == list(range(len(info["devices"])))
    assert info["chosen"] == vk_default.caps.index
    chosen = info["devices"][info["chosen"]]
    assert chosen["name"] == vk_default.caps.name
    for key in ("device_type", "subgroup_size", "unified_memory", "access_path", "max_allocation",
                "max_storage_range", "storage_buffer_16bit", "shader_float16"):
        assert key in chosen, key


def test_devices_human_names_the_device(vk_default: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "devices")
    assert code == 0
    assert f"* {vk_default.caps.index}: {vk_default.caps.name}" in out
    assert f"chosen: {vk_default.caps.index} {vk_default.caps.name}" in out
    assert f"kernel access path: {vk_default.caps.access_path}" in out


def test_ops_json(vk_default: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ops", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["vulkan_available"] is True
    assert info["access_path"] in ("texel", "ssbo")
    rows = {row["op"]: row for row in info["ops"]}
    assert set(rows) == set(OPS)
    assert len(rows) == len(info["ops"])  # one row per op
    for name, row in rows.items():
        assert row["reference"] == "numpy"
        native = [k.name for k in vk_default.kernels(name)]
        if native:
            assert row["vulkan"] == native, name
        else:
            assert row["vulkan"] == "reference (drain)", name
        assert row["doc"] == OPS[name].doc
    assert isinstance(rows["add"]["vulkan"], list)  # add has had a native kernel from the start


def test_ops_human_lists_every_op(vk_default: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ops")
    assert code == 0
    listed = {line.split()[0] for line in out.splitlines()[3:] if line.strip()}
    assert listed == set(OPS)


def test_error_is_one_line_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "pull", "nosuchmodel")
    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("vkrt: error: ") and "nosuchmodel" in lines[0]
    assert "Traceback" not in err


def test_debug_reraises(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(VkrtError, match="nosuchmodel"):
        main(["--debug", "pull", "nosuchmodel"])


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2


def _subcommands() -> list[str]:
    import argparse

    from vkrt.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse formats help strings with %: a literal '%' in one crashed `vkrt bench --help`.
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: vkrt {command}"), out[:200]


def test_bench_compares_prompt_lengths_round_by_round(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.conftest import FIXTURES

    code, out, _ = run(capsys, "bench", "--model", str(FIXTURES / "tiny_llama"), "--device", "reference",
                       "-p", "4,12", "-g", "3", "--repeat", "3", "--json")
    assert code == 0
    report = json.loads(out)
    assert [p["prompt_tokens"] for p in report["prompts"]] == [4, 12]
    assert report["gen_tokens"] == 3
    first, second = (p["runs"] for p in report["prompts"])
    assert len(first) == len(second) == 3
    (ratio,) = report["vs_first"]
    assert ratio["prompt_tokens"] == 12
    for phase in ("prefill", "decode"):
        key = f"{phase}_tok_s"
        expected = [b[key] / a[key] for a, b in zip(first, second, strict=True)]
        assert ratio[phase] == pytest.approx(expected)
        assert ratio[f"{phase}_median"] == pytest.approx(sorted(expected)[1])
    # Each length's best decode run is its headline figure, as with one length.
    for p in report["prompts"]:
        assert p["decode_tok_s"] == max(r["decode_tok_s"] for r in p["runs"])


def test_bench_reports_the_host_load_around_its_runs(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1-minute load average before the first run and after the last, in JSON and text, so a
    run beside other work is told apart from one on an idle machine; none where the OS has none."""
    from tests.conftest import FIXTURES

    readings = iter([0.5, 3.25])
    monkeypatch.setattr("os.getloadavg", lambda: (next(readings), 0.0, 0.0))
    args = ("bench", "--model", str(FIXTURES / "tiny_llama"), "--device", "reference", "-p", "4", "-g", "2",
            "--repeat", "2")
    code, out, _ = run(capsys, *args, "--json")
    assert code == 0
    assert json.loads(out)["host_load"] == {"before": 0.5, "after": 3.25}
    readings = iter([1.0, 2.0])
    code, out, _ = run(capsys, *args)
    assert code == 0 and "host load 1.00 before, 2.00 after" in out.splitlines()[0]

    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average")

    monkeypatch.setattr("os.getloadavg", unavailable)
    code, out, _ = run(capsys, *args, "--json")
    assert code == 0 and json.loads(out)["host_load"] == {"before": None, "after": None}


@pytest.mark.parametrize("flags", [[], ["--no-warmup"]], ids=["warmup", "no-warmup"])
def test_bench_warms_up_untimed_unless_told_not_to(flags: list[str], capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One untimed run of the first length before the timed ones (pipeline creation and step
    recording out of the figures), as llama-bench does; --no-warmup times the first run too."""
    from tests.conftest import FIXTURES
    from vkrt import cli_generate

    calls: list[int] = []
    original = cli_generate._run_once

    def counting(llm: Any, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(prompt))
        return original(llm, prompt, *args, **kwargs)

    monkeypatch.setattr(cli_generate, "_run_once", counting)
    code, out, _ = run(capsys, "bench", "--model", str(FIXTURES / "tiny_llama"), "--device", "reference",
                       "-p", "5", "-g", "2", "--repeat", "2", "--json", *flags)
    assert code == 0
    report = json.loads(out)
    assert report["warmup"] is not flags
    assert len(report["runs"]) == 2
    assert calls == [5] * (2 if flags else 3)


@pytest.mark.parametrize("value", ["0", "4,x", "4,,8", "-3", "8,8"])
def test_bench_rejects_bad_prompt_lengths(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "-p", value])
    assert info.value.code == 2
    assert "--prompt-tokens" in capsys.readouterr().err
