"""tools/spec_ceiling.py: the offline replay counts the steps the engine's rules would run (checked
by hand on short streams, and against the engine itself on the default model), the oracle cuts each
proposal to the accepted run, and a step's cost is priced as documented."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.tools.conftest import load_tool

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11]


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("spec_ceiling")


def test_a_copy_accepted_in_full(tool: ModuleType) -> None:
    # After the prefill's 12: [13, 14, 15] proposed and accepted (4 rows), then the room left is one token: [17].
    output = [12, 13, 14, 15, 16, 17, 50]
    assert tool.simulate(PROMPT, output, 3, 4, 2) == [4, 2]
    assert tool.simulate(PROMPT, output, 3, 4, 2, oracle=True) == [4, 2]


def test_a_rejection_and_the_oracle(tool: ModuleType) -> None:
    # [13, 14] proposed, 13 accepted, 77 where 14 was guessed: the engine verified 3 rows, the oracle
    # only the accepted one; the last token has no room for a proposal.
    output = [12, 13, 77, 78]
    assert tool.simulate(PROMPT, output, 3, 4, 2) == [3, 1]
    assert tool.simulate(PROMPT, output, 3, 4, 2, oracle=True) == [2, 1]


def test_nothing_accepted_backs_off(tool: ModuleType) -> None:
    # After 7 8 9 the prompt had 5; 6 rejects it, so the next step proposes nothing although 9 6 recurs
    # (it would propose 4, which the target then makes): back-off waits one step after a rejection.
    prompt = [9, 6, 4, 7, 8, 9, 5, 7, 8]
    assert tool.simulate(prompt, [9, 6, 4, 2], 1, 4, 2) == [2, 1, 1]


def test_step_cost(tool: ModuleType) -> None:
    costs = {1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0}
    assert tool.step_cost(costs, 3) == 2.0  # the next larger count the run made
    assert tool.step_cost(costs, 8) == 4.0
    assert tool.step_cost(costs, 16) == pytest.approx(8.0)  # the line through 4 and 8 rows


def test_the_replay_counts_the_engines_own_steps(tool: ModuleType, smollm2_path: Path) -> None:
    """On the default model the replay of the greedy ids makes exactly the steps the engine made."""
    from vkrt.engine import LLM, SamplingParams
    from vkrt.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 7})
    llm = LLM(smollm2_path, max_model_len=512, max_num_seqs=1, enable_prefix_caching=False, speculative=spec)
    rows: list[int] = []
    llm.engine.stats_listeners.append(lambda s: rows.append(s.step.num_tokens) if s.num_prompt_tokens == 0 else None)
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    assert llm.tokenizer is not None
    prompt = list(llm.tokenizer.encode(f"Here is some code.\n\n{code}\nThe same code again:\n\n"))
    [out] = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert max(rows) > 1  # it did speculate
    assert tool.simulate(prompt, list(out.outputs[0].token_ids), 7, 4, 2) == rows


def test_the_report(tool: ModuleType, smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A short run end to end: costs by rows start at 1, every policy has a prediction, and the
    host's load average before and after the timed runs is reported."""
    import json

    readings = iter([0.25, 1.5])
    monkeypatch.setattr("os.getloadavg", lambda: (next(readings), 0.0, 0.0))

    prompt = tmp_path / "copy.txt"
    prompt.write_text("one two three four five six seven eight\none two three four five six seven eight\none two")
    assert tool.main(["--model", str(smollm2_path), "--prompt-file", str(prompt), "-g", "12", "-k", "3",
                      "--repeat", "1", "--max-model-len", "128", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step_cost_by_rows"]["1"] == 1.0 and report["gen_tokens"] == 12
    assert set(report["policies"]) == {"engine", "oracle", "every row accepted"}
    assert all(p["predicted_ratio"] > 0 for p in report["policies"].values())
    assert report["host_load"] == {"before": 0.25, "after": 1.5}


def test_bad_input_is_one_line(tool: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tool.main(["--prompt-file", str(tmp_path / "missing.txt"), "-g", "8"]) == 1
    assert "spec_ceiling: error:" in capsys.readouterr().err
    assert tool.main(["--prompt-file", str(tmp_path / "missing.txt"), "-k", "99"]) == 1
    assert "num_speculative_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--prompt-file", "x", "-g", "1"])
    assert exit_.value.code == 2
