"""Structured output over HTTP: response_format, vLLM's structured_outputs and llama.cpp's
json_schema / grammar, against a live server over the real SmolLM2 with the openai client.

Whatever the 135M model would rather say, the output must satisfy the constraint; the checks
are independent of vkrt: pydantic validates JSON, Python's `re` checks regex matches.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.live_model import LiveModel, live_model

MESSAGES: list[Any] = [{"role": "user", "content": "Describe a person as JSON."}]


class Role(str, enum.Enum):
    admin = "admin"
    guest = "guest"


class Address(BaseModel):
    city: str = Field(max_length=12)
    floor: int = Field(ge=0, le=9)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=18, le=99)
    role: Role
    address: Address
    # Every string is bounded, so a valid object fits max_tokens whatever the sampler draws
    # (an unbounded tag once ran a seeded draw past 200 tokens).
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=2)
    nickname: str | None = Field(default=None, max_length=8)


class Reading(BaseModel):
    sensor: str = Field(max_length=10)
    values: list[float] = Field(min_length=1, max_length=3)
    ok: bool


@pytest.fixture(scope="module")
def live(smollm2_path: Path) -> Iterator[LiveModel]:
    with live_model(smollm2_path, max_model_len=512, max_num_seqs=16) as server:
        yield server


def _client(live: LiveModel) -> openai.AsyncOpenAI:
    return live.async_client(timeout=900)


def test_parse_schemas_streamed_and_not(live: LiveModel) -> None:
    """parse() gives a validated object for nested, array, enum, bounded and optional fields;
    the streamed form's final message parses to the same schema."""
    client = _client(live)

    async def parse(model: type[BaseModel], seed: int) -> Any:
        completion = await client.chat.completions.parse(
            model="smollm2", messages=MESSAGES, response_format=model, max_tokens=200, temperature=0.8,
            seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        return choice.message.parsed

    async def streamed(model: type[BaseModel], seed: int) -> tuple[Any, str]:
        text = ""
        async with client.chat.completions.stream(
                model="smollm2", messages=MESSAGES, response_format=model, max_tokens=200, temperature=0.8,
                seed=seed) as stream:
            async for event in stream:
                if event.type == "content.delta":
                    text += event.delta
            final = await stream.get_final_completion()
        return final.choices[0].message.parsed, text

    async def run() -> list[Any]:
        return await asyncio.gather(parse(Person, 1), parse(Person, 2), parse(Reading, 3),
                                    streamed(Person, 4), streamed(Reading, 5))

    person1, person2, reading, (person_s, person_text), (reading_s, _) = asyncio.run(run())
    for person in (person1, person2, person_s):
        assert isinstance(person, Person)
        assert 18 <= person.age <= 99 and 0 <= person.address.floor <= 9 and len(person.tags) <= 2
    for value in (reading, reading_s):
        assert isinstance(value, Reading) and 1 <= len(value.values) <= 3
    # The deltas are the whole output: they validate on their own.
    assert Person.model_validate_json(person_text) == person_s


def test_json_object_and_cutoffs(live: LiveModel) -> None:
    """json_object output is a JSON object; max_tokens cuts a constrained output with
    "length", streamed or not; a stop string still stops it."""
    client = _client(live)
    schema = Person.model_json_schema()
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}

    async def chat(**kwargs: Any) -> Any:
        return (await client.chat.completions.create(model="smollm2", messages=MESSAGES, **kwargs)).choices[0]

    async def stream_finish(**kwargs: Any) -> tuple[str, str | None]:
        text, finish = "", None
        async for chunk in await client.chat.completions.create(model="smollm2", messages=MESSAGES, stream=True,
                                                                **kwargs):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run() -> list[Any]:
        return await asyncio.gather(
            chat(response_format={"type": "json_object"}, max_tokens=120, seed=7),
            chat(response_format=fmt, max_tokens=4, seed=8),
            stream_finish(response_format=fmt, max_tokens=4, seed=9),
            chat(response_format=fmt, max_tokens=120, seed=10, stop=['"age"']),
        )

    obj, cut, (cut_text, cut_finish), stopped = asyncio.run(run())
    assert obj.finish_reason == "stop", obj.message.content
    assert isinstance(json.loads(obj.message.content), dict)
    assert cut.finish_reason == "length" and cut_finish == "length"
    assert cut.message.content.startswith("{") and cut_text.startswith("{")
    assert stopped.finish_reason == "stop"
    # The schema's first property is "name", so the output reached "age" only after it.
    assert '"age"' not in stopped.message.content and stopped.message.content.startswith('{')


def test_regex_choice_grammar_over_seeds(live: LiveModel) -> None:
    """vLLM's structured_outputs regex / choice and llama.cpp's json_schema / GBNF grammar hold
    for every seed, on completions and chat."""
    client = _client(live)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    colours = ["red", "green", "light blue"]
    seeds = range(4)

    async def complete(extra: dict[str, Any], seed: int) -> Any:
        result = await client.completions.create(model="smollm2", prompt="Here it is:", max_tokens=30,
                                                 temperature=1.0, seed=seed, extra_body=extra)
        return result.choices[0]

    async def chat(extra: dict[str, Any], seed: int) -> Any:
        result = await client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=30,
                                                      temperature=1.0, seed=seed, extra_body=extra)
        return result.choices[0]

    async def run() -> list[Any]:
        return await asyncio.gather(
            *[complete({"structured_outputs": {"regex": pattern}}, s) for s in seeds],
            *[chat({"structured_outputs": {"choice": colours}}, s) for s in seeds],
            *[complete({"grammar": 'root ::= "yes" | "no" | "maybe"'}, s) for s in seeds],
            *[complete({"json_schema": {"type": "integer", "minimum": 3, "maximum": 7}}, s) for s in seeds],
            *[chat({"structured_outputs": {"grammar": 'start: "A" /[0-9]/ "!"'}}, s) for s in seeds],
        )

    results = asyncio.run(run())
    regex, choice, gbnf, integer, lark = (results[k:k + len(seeds)] for k in range(0, len(results), len(seeds)))
    for c in regex:
        assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c.text
    for c in choice:
        assert c.message.content in colours and c.finish_reason == "stop"
    for c in gbnf:
        assert c.text in ("yes", "no", "maybe")
    for c in integer:
        assert 3 <= json.loads(c.text) <= 7
    for c in lark:
        assert re.fullmatch(r"A[0-9]!", c.message.content)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"type": "x"}}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": '{"structures": [{"begin": "<f>", "end": "</f>"}], '
                                               '"triggers": ["<g"]}'}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar"),
])
def test_bad_constraints_are_400(live: LiveModel, body: dict[str, Any], param: str) -> None:
    """A bad constraint is a 400 naming the field, streamed or not, and the server keeps serving."""
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=900)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4, stream=stream,
                                           extra_body=body)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, error
    ok = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


# ---- over a scripted model ------------------------------------------------------------------
# The fake engine writes a script except where the grammar's mask refuses a token, so these
# show exactly what the server's grammar lets a model write.

class City(BaseModel):
    model_config = {"extra": "forbid", "strict": True}
    name: str
    population: int


CITY_SCHEMA = {"type": "object", "required": ["name", "population"], "additionalProperties": False,
               "properties": {"name": {"type": "string"}, "population": {"type": "integer"}}}


def _scripted(serve_fake: Any, script: str, **config: Any) -> openai.OpenAI:
    from tests.server.fake_engine import FakeEngine

    live = serve_fake(FakeEngine(max_model_len=2048, script=script), **config)
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _reply(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=1500, **kwargs).choices[0]


def test_llama_cpp_json_object_with_schema_is_honoured(serve_fake: Any) -> None:
    """response_format {"type": "json_object", "schema": ...} (llama.cpp's form, instructor's
    JSON_SCHEMA mode) constrains to the schema, not to any object: a script that writes the
    population as text, then as a number, gets the number. The same for {"type": "json_schema",
    "schema": ...} and the request's top-level json_schema; plain json_object stays any object."""
    script = '{"name": "Lyon", "population": "many", "population": 522250}'
    for form in ({"response_format": {"type": "json_object", "schema": CITY_SCHEMA}},
                 {"response_format": {"type": "json_schema", "schema": CITY_SCHEMA}},
                 {"extra_body": {"json_schema": CITY_SCHEMA}}):
        choice = _reply(_scripted(serve_fake, script), **form)
        assert choice.finish_reason == "stop", (form, choice.message.content)
        assert choice.message.content == '{"name": "Lyon", "population": 522250}', form
        assert City.model_validate_json(choice.message.content) == City(name="Lyon", population=522250)
    anything = _reply(_scripted(serve_fake, '{"name": "Lyon", "population": "many"}'),
                      response_format={"type": "json_object"})
    assert json.loads(anything.message.content) == {"name": "Lyon", "population": "many"}
    # A bad schema in that form is a 400 naming response_format.
    client = _scripted(serve_fake, script)
    with pytest.raises(openai.BadRequestError) as caught:
        _reply(client, response_format={"type": "json_object", "schema": {"type": "frobnicate"}})
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True])
def test_unbounded_integer_ends_at_16_digits(serve_fake: Any, stream: bool) -> None:
    """A small model's run-on "population": 1111... ends: an integer the schema leaves
    unbounded takes 16 digits at most (the 17th is masked), a number 10 after the point, in
    any JSON object too; the schema's own bounds are kept, and --json-max-digits changes
    the default (0: unbounded)."""
    ones = "1" * 40

    def content(client: openai.OpenAI, **kwargs: Any) -> Any:
        if not stream:
            choice = _reply(client, **kwargs)
            assert choice.finish_reason == "stop", choice.message.content
            return json.loads(choice.message.content)
        text, finish = "", None
        for chunk in client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=1500, stream=True,
                                                    **kwargs):
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop", text
        return json.loads(text)

    script = f'{{"name": "Lyon", "population": {ones}}}'
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    assert content(_scripted(serve_fake, script), response_format=fmt)["population"] == int("1" * 16)
    assert content(_scripted(serve_fake, script), response_format={"type": "json_object"})["population"] == int(
        "1" * 16)
    ratio = {"type": "object", "properties": {"ratio": {"type": "number"}}, "required": ["ratio"]}
    assert content(_scripted(serve_fake, '{"ratio": 0.' + "3" * 40 + "}"), extra_body={"json_schema": ratio}) == {
        "ratio": float("0." + "3" * 10)}
    wide = {**CITY_SCHEMA, "properties": {**CITY_SCHEMA["properties"], "population": {
        "type": "integer", "minimum": 0, "maximum": 10**18}}}
    assert content(_scripted(serve_fake, script), extra_body={"json_schema": wide})["population"] == int("1" * 18)
    assert content(_scripted(serve_fake, script, json_max_digits=4), response_format=fmt)["population"] == 1111
    assert content(_scripted(serve_fake, script, json_max_digits=0), response_format=fmt)["population"] == int(ones)


def test_json_max_digits_out_of_range_is_refused() -> None:
    from vkrt.errors import VkrtError
    from vkrt.server import ServerConfig

    with pytest.raises(VkrtError, match=r"--json-max-digits must be in \[0, 18\]"):
        ServerConfig(json_max_digits=19).validate()
