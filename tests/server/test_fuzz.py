"""Schemathesis against a live server on 127.0.0.1: 0 server errors, 0 schema violations.

Two lanes. The main one runs over the fake engine, so it can afford a few hundred examples
per mode: the fuzzer aims at the HTTP, validation, template and error layers, which are
the same either way. The second runs `vkrt serve`'s own app over the real default model
(SmolLM2 on llvmpipe, contexts capped at 64 tokens) with a few examples per operation, so
the real engine, tokenizer, chat template and sampling answer schema-valid bodies too.
Every operation gets schema-valid bodies (positive) and schema-breaking ones (negative,
which must be refused with a 4xx); examples come from a fixed seed, derandomised.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from tests.server.fake_engine import FakeEngine
from tests.server.live_model import live_model
from vkrt.server import ServerConfig, build_app
from vkrt.server.background import BackgroundServer

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a dev extra (pip install -e .[dev])")

from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

API_KEY = "fuzz-key"
EXAMPLES_PER_OPERATION = 80  # per generation mode and operation; the run takes about a minute on 2 cores
REAL_MODEL_EXAMPLES = 25  # per mode and operation on the real model: each accepted body generates
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    config = ServerConfig(served_model_name="fake", api_key=API_KEY, max_prompt_chars=4096,
                          chat_template_timeout=2.0)
    with BackgroundServer(build_app(FakeEngine(max_model_len=64), config)) as server:
        yield server.url


def _operations(url: str, minimum: int) -> list[object]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"})
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= minimum, [op.label for op in operations]  # type: ignore[attr-defined]
    return operations


@pytest.fixture(scope="module")
def real_model_url(smollm2_path: Path) -> Iterator[str]:
    with live_model(smollm2_path, max_model_len=64, max_num_seqs=8, api_key=API_KEY, max_prompt_chars=4096,
                    chat_template_timeout=2.0) as server:
        yield server.url


MODES = pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])


@MODES
def test_schemathesis_finds_no_server_error_or_schema_violation(server_url: str, mode: GenerationMode) -> None:
    statuses = fuzz(server_url, mode, EXAMPLES_PER_OPERATION)
    # It really fuzzed: many requests, some accepted, some refused (the negative ones all are).
    assert sum(statuses.values()) >= 100, statuses
    assert statuses.keys() & {400, 404, 413}, statuses
    if mode is GenerationMode.POSITIVE:
        assert statuses.get(200, 0) >= 20, statuses


@MODES
def test_schemathesis_on_the_real_model(real_model_url: str, mode: GenerationMode) -> None:
    statuses = fuzz(real_model_url, mode, REAL_MODEL_EXAMPLES)
    assert sum(statuses.values()) >= 20, statuses
    if mode is GenerationMode.POSITIVE:
        assert statuses.get(200, 0) >= 5, statuses  # the real engine generated for some of them


def fuzz(url: str, mode: GenerationMode, examples: int, minimum_operations: int = 8) -> dict[int, int]:
    """Fuzz every operation of `url`'s OpenAPI document (with the key API_KEY); fail on any
    check; responses by status."""
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])
    failures: list[str] = []
    statuses: dict[int, int] = {}
    for operation in _operations(url, minimum_operations):
        try:
            strategy = operation.as_strategy(generation_mode=mode)  # type: ignore[attr-defined]
        except Exception as exc:  # an operation with nothing to break in negative mode
            if mode is GenerationMode.NEGATIVE:
                continue
            raise AssertionError(f"{operation.label}: {exc}") from exc  # type: ignore[attr-defined]

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=strategy)
        def run(case: object) -> None:
            response = case.call(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"},  # type: ignore[attr-defined]
                                 timeout=120)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            try:
                case.validate_response(response, checks=checks)  # type: ignore[attr-defined]
            except Exception as exc:
                failures.append(f"{case.operation.label}: {str(exc)[:800]}")  # type: ignore[attr-defined]
                raise

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recorded = len(failures)
            try:
                run()
            except Unsatisfiable:  # nothing to break (no parameters): only negative mode may meet it
                if mode is not GenerationMode.NEGATIVE:
                    failures.append(f"{operation.label}: no example could be generated")  # type: ignore[attr-defined]
            except Exception as exc:  # keep fuzzing the other operations
                if len(failures) == recorded:  # not a failed check (those are recorded): a call that broke
                    failures.append(f"{operation.label}: {type(exc).__name__}: {str(exc)[:800]}")  # type: ignore[attr-defined]
    assert not failures, "\n\n".join(failures)
    print(f"schemathesis {mode.value} on {url}: responses by status {dict(sorted(statuses.items()))}")
    return statuses
