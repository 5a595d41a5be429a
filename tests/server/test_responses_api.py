"""POST /v1/responses through the official openai SDK over the scripted fake engine."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.server.fake_engine import FakeEngine
from vkrt.server import ServerConfig, build_app
from vkrt.server.background import BackgroundServer

TOOL: Any = {"type": "function", "name": "f", "strict": False,
             "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


class City(BaseModel):
    name: str


def _serve(script: str, **config: Any) -> BackgroundServer:
    return BackgroundServer(build_app(FakeEngine(max_model_len=512, script=script),
                                      ServerConfig(served_model_name="fake", **config)))


def _client(server: BackgroundServer, key: str = "k") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_text_streamed_and_not() -> None:
    with _serve("Paris is nice") as server:
        client = _client(server)
        response = client.responses.create(model="fake", input="hi", instructions="be brief")
        assert (response.status, response.output_text) == ("completed", "Paris is nice")
        assert response.id.startswith("resp_") and response.usage is not None and response.usage.output_tokens > 0
        with client.responses.stream(model="fake", input=[{"role": "user", "content": "hi"}]) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        assert final.output_text == "Paris is nice"
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]


def test_function_call_streamed_and_not() -> None:
    with _serve(CALL) as server:
        client = _client(server)
        response = client.responses.create(model="fake", input="hi", tools=[TOOL])
        [call] = response.output
        assert call.type == "function_call" and (call.name, call.arguments) == ("f", '{"x": 1}')
        with client.responses.stream(model="fake", input="hi", tools=[TOOL]) as stream:
            kinds = [event.type for event in stream]
            [streamed] = stream.get_final_response().output
        assert streamed.type == "function_call" and streamed.arguments == '{"x": 1}'
        assert "response.function_call_arguments.done" in kinds


def test_json_schema_incomplete_and_refusals() -> None:
    with _serve('{"name": "Paris"}', api_key="k") as server:
        client = _client(server)
        assert client.responses.parse(model="fake", input="city?", text_format=City).output_parsed == City(name="Paris")
        short = client.responses.create(model="fake", input="hi", max_output_tokens=3)
        assert short.status == "incomplete" and short.incomplete_details is not None
        assert short.incomplete_details.reason == "max_output_tokens"
        with pytest.raises(openai.BadRequestError, match="stateless"):
            client.responses.create(model="fake", input="hi", previous_response_id="resp_x")
        with pytest.raises(openai.AuthenticationError):
            _client(server, "wrong").responses.create(model="fake", input="hi")
