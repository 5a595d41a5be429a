"""vLLM's and llama-server's request extras, called as the openai SDK sends them
(`extra_body`) over a fake engine: token ids in the response, tokens named by id in
logprobs, allowed ids, prompt truncation, /invocations, the routes under the root path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import Live
from tests.server.fake_engine import EOS, FakeEngine
from vkrt.tokenizer import Tokenizer


def _client(live: Live, base: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}{base}", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def scripted(serve_fake: Callable[..., Live]) -> Live:
    return serve_fake(FakeEngine(max_model_len=256, script="Hi there"))


def test_completion_returns_prompt_and_output_token_ids(scripted: Live) -> None:
    client = _client(scripted)
    whole = client.completions.create(model="fake", prompt="ab", max_tokens=20, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.text == "Hi there"
    assert choice.prompt_token_ids == [97, 98]  # type: ignore[attr-defined]
    assert choice.token_ids == [*b"Hi there", EOS]  # type: ignore[attr-defined]
    chunks = list(client.completions.create(model="fake", prompt="ab", max_tokens=20, stream=True,
                                            extra_body={"return_token_ids": True}))
    streamed = [c.choices[0] for c in chunks]
    assert streamed[0].prompt_token_ids == [97, 98]  # type: ignore[attr-defined]
    assert all(getattr(c, "prompt_token_ids", None) is None for c in streamed[1:])
    assert sum((c.token_ids for c in streamed), []) == choice.token_ids  # type: ignore[attr-defined]
    plain = client.completions.create(model="fake", prompt="ab", max_tokens=20)
    assert "token_ids" not in plain.choices[0].model_extra  # type: ignore[operator]


def test_chat_returns_prompt_and_output_token_ids(scripted: Live) -> None:
    client = _client(scripted)
    messages: Any = [{"role": "user", "content": "x"}]
    prompt = scripted.engine.tokenizer.encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")
    whole = client.chat.completions.create(model="fake", messages=messages, extra_body={"return_token_ids": True})
    assert whole.prompt_token_ids == prompt  # type: ignore[attr-defined]
    assert whole.choices[0].token_ids == [*b"Hi there", EOS]  # type: ignore[attr-defined]
    chunks = list(client.chat.completions.create(model="fake", messages=messages, stream=True,
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].prompt_token_ids == prompt  # type: ignore[attr-defined]
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    streamed = sum((c.choices[0].token_ids for c in chunks), [])  # type: ignore[attr-defined]
    assert streamed == whole.choices[0].token_ids  # type: ignore[attr-defined]


def test_tool_call_stream_keeps_every_token_id(serve_fake: Callable[..., Live]) -> None:
    """A call's text is held back while it is parsed; its ids still reach the client, later."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    live = serve_fake(FakeEngine(max_model_len=512, script=call), tool_call_parser="hermes")
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chunks = list(_client(live).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], tools=tools, stream=True,
        extra_body={"return_token_ids": True}))
    streamed = sum((c.choices[0].token_ids for c in chunks), [])  # type: ignore[attr-defined]
    assert streamed == [*live.engine.tokenizer.encode(call), EOS]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logprob_tokens_named_by_id(fake: Live) -> None:
    client = _client(fake)
    completion = client.completions.create(model="fake", prompt="hi", max_tokens=2, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True})
    assert completion.choices[0].logprobs.tokens == ["token_id:97", "token_id:98"]  # type: ignore[union-attr]
    assert completion.choices[0].logprobs.top_logprobs[0] == {"token_id:97": -0.25}  # type: ignore[union-attr]
    chat = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [entry.token for entry in content] == ["token_id:97", "token_id:98"]  # type: ignore[union-attr]
    assert [alt.token for alt in content[0].top_logprobs] == ["token_id:97", "token_id:98"]  # type: ignore[index]
    assert content[0].bytes == [97]  # type: ignore[index]
    streamed = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2, logprobs=True, stream=True,
                                              extra_body={"return_tokens_as_token_ids": True})
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content or []]
    assert tokens == ["token_id:97", "token_id:98"]


def test_allowed_token_ids_reach_the_sampler_and_are_checked(fake: Live) -> None:
    client = _client(fake)
    client.completions.create(model="fake", prompt="hi", max_tokens=2, extra_body={"allowed_token_ids": [97, 98]})
    assert fake.engine.requests[-1][2].allowed_token_ids == [97, 98]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"allowed_token_ids": [97, 100000]})
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "allowed_token_ids"  # type: ignore[index]
    assert "100000" in caught.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(("side", "kept"), [(None, b"cdef"), ("left", b"cdef"), ("right", b"abcd")])
def test_truncate_prompt_tokens_keeps_one_end(fake: Live, side: str | None, kept: bytes) -> None:
    extra: dict[str, Any] = {"truncate_prompt_tokens": 4, **({"truncation_side": side} if side else {})}
    completion = _client(fake).completions.create(model="fake", prompt="abcdef", max_tokens=1, echo=True,
                                                  extra_body=extra)
    assert fake.engine.requests[-1][1] == list(kept)
    assert completion.usage is not None and completion.usage.prompt_tokens == 4
    assert completion.choices[0].text == kept.decode() + "a"  # the echo is the prompt that ran
    _client(fake).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=1, extra_body=extra)
    rendered = fake.engine.tokenizer.encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")
    assert fake.engine.requests[-1][1] == (rendered[:4] if side == "right" else rendered[-4:])


def test_truncate_prompt_tokens_bounds(fake: Live) -> None:
    client = _client(fake)
    client.completions.create(model="fake", prompt="x" * 70, max_tokens=1, extra_body={"truncate_prompt_tokens": 5})
    assert len(fake.engine.requests[-1][1]) == 5  # a prompt longer than the context, cut to fit
    for bad in (0, -2, 65):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="fake", prompt="abc", max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": bad})
        assert caught.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake", prompt="abc", extra_body={"truncation_side": "middle"})


def test_invocations_dispatches_on_the_body(scripted: Live) -> None:
    """SageMaker's one route: a body with messages is a chat request, one with prompt a completion."""
    http = scripted.client
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"]["content"] == "Hi there"
    completion = http.post("/invocations", json={"prompt": "ab", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert completion.json()["choices"][0]["text"] == "Hi "
    streamed = http.post("/invocations", json={"prompt": "ab", "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n")
    for body, param in (({"input": "x"}, None), ([1, 2], None), ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
                        ({"messages": []}, "messages")):
        refused = http.post("/invocations", json=body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
    broken = http.post("/invocations", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"


def test_openai_routes_answer_under_the_root_path(serve_fake: Callable[..., Live]) -> None:
    """The openai SDK with a base URL without /v1 (llama-server answers there too); auth applies."""
    live = serve_fake(FakeEngine(max_model_len=256, script="Hi there"), api_key="k")
    client = openai.OpenAI(base_url=live.url, api_key="k", max_retries=0, timeout=30)
    assert client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}]) \
        .choices[0].message.content == "Hi there"
    assert client.completions.create(model="fake", prompt="ab").choices[0].text == "Hi there"
    assert [m.id for m in client.models.list()] == ["fake"]
    assert live.client.post("/chat/completions", json={"messages": []}).status_code == 401
    paths = live.client.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]
    assert "/invocations" in paths and "/v1/chat/completions" in paths and "/chat/completions" not in paths


def test_tokenize_token_strs_are_vocabulary_pieces(serve_fake: Callable[..., Live], smollm2_path: Path) -> None:
    engine = FakeEngine()
    engine.tokenizer = Tokenizer.from_gguf(smollm2_path)  # type: ignore[assignment]
    live = serve_fake(engine)
    body = live.client.post("/tokenize", json={"prompt": "This is\nit", "return_token_strs": True}).json()
    assert body["token_strs"] == ["This", "Ġis", "Ċ", "it"]
    assert body["tokens"] == engine.tokenizer.encode("This is\nit")


def test_completion_prompt_mixing_text_and_ids_is_one_prompt(fake: Live) -> None:
    """llama-server's [12, "text", 34]: each string tokenised on its own, the ids kept as given."""
    completion = _client(fake).completions.create(model="fake", prompt=[257, "hi", 258, "yo"], max_tokens=1,  # type: ignore[list-item]
                                                  echo=True)
    assert fake.engine.requests[-1][1] == [257, *b"hi", 258, *b"yo"]
    assert len(completion.choices) == 1 and completion.choices[0].text == "hiyoa"  # special tokens decode away


def test_context_exceeded_says_how_many_tokens(fake: Live) -> None:
    """llama-server's n_prompt_tokens and n_ctx beside the OpenAI error fields, for either limit."""
    client = _client(fake)
    for extra in ({"prompt": "x" * 70}, {"prompt": "x" * 10, "max_tokens": 60}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="fake", **extra)  # type: ignore[call-overload]
        error = caught.value.body
        assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"  # type: ignore[index]
        assert (error["n_prompt_tokens"], error["n_ctx"]) == (len(extra["prompt"]), 64)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x" * 80}])
    assert caught.value.body["param"] == "messages" and caught.value.body["n_ctx"] == 64  # type: ignore[index]
    assert "n_ctx" not in fake.client.post("/v1/completions", json={"prompt": ""}).json()["error"]


CHAT_TURN = "<|im_start|>user\nx<|im_end|>\n"


@pytest.mark.parametrize(("flags", "prompt"), [
    ({}, CHAT_TURN + "<|im_start|>assistant\nThe answer is"),  # llama-server's prefill
    ({"add_generation_prompt": False, "continue_final_message": True}, CHAT_TURN + "<|im_start|>assistant\nThe answer is"),
    ({"add_generation_prompt": True}, CHAT_TURN + "<|im_start|>assistant\nThe answer is<|im_end|>\n<|im_start|>assistant\n"),
])
def test_a_final_assistant_message_is_continued(fake: Live, flags: dict[str, Any], prompt: str) -> None:
    """Unless the client asks for a new turn, the reply goes on from the final assistant text,
    and /tokenize renders the conversation the same way."""
    messages: Any = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]
    _client(fake).chat.completions.create(model="fake", messages=messages, max_tokens=1, extra_body=flags)
    assert fake.engine.requests[-1][1] == fake.engine.tokenizer.encode(prompt)
    tokens = fake.client.post("/tokenize", json={"messages": messages, **flags}).json()["tokens"]
    assert tokens == fake.engine.tokenizer.encode(prompt)


def test_a_final_assistant_tool_call_opens_a_new_turn(fake: Live) -> None:
    messages: Any = [{"role": "user", "content": "x"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    _client(fake).chat.completions.create(model="fake", messages=messages, max_tokens=1)
    assert fake.engine.tokenizer.decode(fake.engine.requests[-1][1], skip_special_tokens=False) \
        .endswith("<|im_end|>\n<|im_start|>assistant\n")
