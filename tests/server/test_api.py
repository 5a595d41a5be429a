"""OpenAI routes over a fake engine: response shapes, SSE framing, request ids, logprobs."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from tests.server.conftest import Live


def sse_events(response: httpx.Response) -> list[Any]:
    """Parse an SSE body strictly: only `data: ...` events separated by blank lines."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def test_completion(fake: Live) -> None:
    r = fake.client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "abcde"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert r.headers["x-request-id"]


def test_completion_token_prompt_and_list_of_one(fake: Live) -> None:
    for prompt in ([104, 105], ["hi"], [[104, 105]]):
        r = fake.client.post("/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 2
    assert fake.engine.requests[-1][1] == [104, 105]


def test_completion_echo_and_stop(fake: Live) -> None:
    r = fake.client.post("/v1/completions", json={"prompt": "hi ", "max_tokens": 8, "stop": ["d"], "echo": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == "hi abc"
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "d"


def test_request_id_header_is_honoured_or_made(fake: Live) -> None:
    r = fake.client.get("/v1/models", headers={"x-request-id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    a, b = fake.client.get("/version"), fake.client.get("/version")
    assert a.headers["x-request-id"] != b.headers["x-request-id"]
    bad = fake.client.post("/v1/completions", content=b"{", headers={"x-request-id": "bad-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"


def test_chat_completion_maps_fields(fake: Live) -> None:
    r = fake.client.post("/v1/chat/completions", json={
        "model": "fake", "max_completion_tokens": 3, "temperature": 0, "seed": 7, "top_k": 5,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "chat_template_kwargs": {"enable_thinking": False}, "stop_token_ids": [258], "ignore_eos": True,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    _, prompt_ids, params, prompt_text = fake.engine.requests[-1]
    assert prompt_text.endswith("/no_think\n<|im_start|>assistant\n")
    assert "be brief" in prompt_text and prompt_ids == fake.engine.tokenizer.encode(prompt_text)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert (params.max_tokens, params.temperature, params.seed, params.top_k) == (3, 0.0, 7, 5)
    assert params.stop_token_ids == [258] and params.ignore_eos


def test_chat_default_max_tokens_fills_the_context(fake: Live) -> None:
    r = fake.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    prompt_len = r.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["completion_tokens"] == fake.engine.max_model_len - prompt_len


def test_completion_stream_framing_and_usage(fake: Live) -> None:
    r = fake.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    events = sse_events(r)
    chunks, usage_chunk = events[:-1], events[-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcd"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in events)
    assert all(c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                                    "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_role_first_then_content(fake: Live) -> None:
    r = fake.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True})
    events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "abc"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[-1]


def test_completion_logprobs(fake: Live) -> None:
    r = fake.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["token_logprobs"] == [-0.25] * 3
    assert lp["top_logprobs"][0] == {"a": -0.25, "b": -1.5}
    assert lp["text_offset"] == [0, 1, 2]
    r = fake.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 1, "stream": True})
    offsets = [e["choices"][0]["logprobs"]["text_offset"] for e in sse_events(r)]
    assert offsets == [[0], [1], [2]]


def test_chat_logprobs(fake: Live) -> None:
    r = fake.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b"]
    assert content[0]["bytes"] == [97] and content[0]["logprob"] == -0.25
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["a", "b"]
    r = fake.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None


def test_models_version_tokenize_detokenize(fake: Live) -> None:
    models = fake.client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake"
    assert models["data"][0]["max_model_len"] == 64
    assert fake.client.get("/version").json()["version"]
    tok = fake.client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert tok == {"count": 2, "max_model_len": 64, "tokens": [104, 105], "token_strs": ["h", "i"]}
    chat = fake.client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["tokens"][0] == 257 and chat["count"] == len(chat["tokens"])
    assert fake.client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert fake.client.post("/detokenize", json={"tokens": [9999]}).status_code == 400
    assert fake.client.post("/tokenize", json={}).status_code == 400


def test_log_requests_truncates_prompt(serve_fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    live = serve_fake(enable_log_requests=True, max_log_len=4)
    with caplog.at_level(logging.INFO, logger="vkrt.server"):
        live.client.post("/v1/completions", json={"prompt": "abcdefghijkl", "max_tokens": 1})
    lines = [r.getMessage() for r in caplog.records if "prompt=" in r.getMessage()]
    assert len(lines) == 1 and "prompt='abcd'" in lines[0] and "efgh" not in lines[0]
    assert "max_tokens=1" in lines[0]
