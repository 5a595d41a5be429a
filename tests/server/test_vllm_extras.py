"""vLLM's request extras, called as the openai SDK sends them (`extra_body`) over a fake
engine: token ids in the response, tokens named by id in logprobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.server.conftest import Live
from tests.server.fake_engine import EOS, FakeEngine


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
