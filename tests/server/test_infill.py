"""POST /infill, llama-server's fill-in-the-middle, as llama.vscode calls it (httpx, its JSON).

The prompt ids come from a tiny tokenizer with Qwen2.5-Coder's FIM tokens, checked against
transformers' ids for the same requests (tests/fixtures/tiny_fim_tokenizer, made by
tools/make_fim_fixture.py); the fake engine behind it answers with a scripted completion.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import Live
from tests.server.fake_engine import FakeEngine
from vkrt.server.infill import infill_prompt
from vkrt.server.protocol import InfillRequest
from vkrt.tokenizer import Tokenizer

FIM_DIR = Path(__file__).parent.parent / "fixtures" / "tiny_fim_tokenizer"
GOLDEN = json.loads((FIM_DIR / "golden.json").read_text(encoding="utf-8"))


@pytest.fixture
def coder(serve_fake: Callable[..., Live]) -> Live:
    engine = FakeEngine(max_model_len=512, script="return a + b")
    engine.tokenizer = Tokenizer.from_hf_dir(FIM_DIR)  # type: ignore[assignment]
    return serve_fake(engine)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda case: str(sorted(case["request"])))
def test_infill_prompt_is_laid_out_as_llama_server_does(coder: Live, case: dict[str, Any]) -> None:
    r = coder.client.post("/infill", json={**case["request"], "n_predict": 8})
    assert r.status_code == 200, r.text
    assert coder.engine.requests[-1][1] == case["prompt_ids"]
    body = r.json()
    assert body["truncated"] is False and body["tokens_evaluated"] == len(case["prompt_ids"])


def test_infill_answer_whole_and_streamed(serve_fake: Callable[..., Live]) -> None:
    live = serve_fake(FakeEngine(max_model_len=512, script="return a + b"))
    request = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 32}
    body = live.client.post("/infill", json=request).json()
    assert body["content"] == "return a + b" and body["stop"] is True and body["stop_type"] == "eos"
    assert body["tokens_predicted"] == len("return a + b") + 1 and body["model"] == "fake"  # and the EOS
    limited = live.client.post("/infill", json={**request, "n_predict": 3}).json()
    assert (limited["content"], limited["stop_type"]) == ("ret", "limit")
    worded = live.client.post("/infill", json={**request, "stop": ["+"]}).json()
    assert (worded["content"], worded["stop_type"], worded["stopping_word"]) == ("return a ", "word", "+")
    streamed = live.client.post("/infill", json={**request, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(block.removeprefix("data: ")) for block in streamed.text.split("\n\n") if block]
    assert "".join(e["content"] for e in events) == "return a + b"
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert events[-1]["tokens_predicted"] == body["tokens_predicted"] and "[DONE]" not in streamed.text


def test_infill_cuts_what_does_not_fit() -> None:
    """Project files go first (from their start), then the prefix's start and the suffix's end,
    the suffix keeping a quarter of the room; the FIM tokens and the prompt always stay."""
    tokenizer: Any = FakeEngine().tokenizer
    request = InfillRequest(input_prefix="p" * 100, input_suffix="s" * 100, prompt="PR",
                            input_extra=[{"filename": "a.py", "text": "x" * 50}])  # type: ignore[list-item]
    ids, cut = infill_prompt(tokenizer, request, room=1000)
    assert not cut and len(ids) == len(tokenizer.encode("myproject\na.py\nfilename\n")) + 50 + 202 + 3 + 3
    ids, cut = infill_prompt(tokenizer, request, room=250)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert cut and len(ids) == 250 and text.endswith("<|fim_prefix|>" + "p" * 100 + "PR<|fim_suffix|>"
                                                     + "s" * 100 + "<|fim_middle|>")
    assert text.startswith("x")  # the files lost their start, the header included
    ids, cut = infill_prompt(tokenizer, request, room=105)
    assert cut and len(ids) == 105
    assert tokenizer.decode(ids, skip_special_tokens=False) == \
        "<|fim_prefix|>" + "p" * 75 + "PR<|fim_suffix|>" + "s" * 25 + "<|fim_middle|>"


def test_infill_errors(coder: Live, serve_fake: Callable[..., Live]) -> None:
    plain = FakeEngine()
    plain.tokenizer.fim_token_ids = {}  # a vocabulary without them
    r = serve_fake(plain).client.post("/infill", json={"input_prefix": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "infill_not_supported"
    assert "fim_prefix" in r.json()["error"]["message"]
    for body, param in (({"input_extra": [{"filename": "a"}]}, "input_extra.0.text"),
                        ({"input_prefix": 5}, "input_prefix"), ({"n_predict": -2}, "n_predict"),
                        ({"n": 2}, "n"), ('{"input_prefix": "\\ud800"}', "input_prefix")):
        r = (coder.client.post("/infill", content=body, headers={"content-type": "application/json"})
             if isinstance(body, str) else coder.client.post("/infill", json=body))
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    r = coder.client.post("/infill", json={"input_prefix": "x" * 600, "n_predict": -1})
    assert r.status_code == 200 and r.json()["truncated"] is True  # cut to leave one token of room
