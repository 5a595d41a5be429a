"""Several models behind one server (vkrt/serve_models): each model its own `vkrt serve` process,
loaded on first use, unloaded least recently used first, named only by configured names.

The models' processes run the numpy reference device: what is tested here is the server in front
of them (routing, loading, unloading, failures, streams, metrics); the models' own serving on
Vulkan is tested under tests/server. Greedy ids are transformers' (the fixtures' goldens).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import FIXTURES
from tests.server import live_model
from vkrt.serve_models import ModelPool, PoolConfig, build_models_app, child_configs, model_paths
from vkrt.serve_models.process import ModelState
from vkrt.server import ServerConfig
from vkrt.server.background import BackgroundServer

LLAMA, QWEN = "tiny_llama", "tiny_qwen3"
GOLDEN = {name: json.loads((FIXTURES / name / "golden.json").read_text())["cases"] for name in (LLAMA, QWEN)}
# What every model's process is started with: small, so loads are quick and memory estimates are small.
BASE = ServerConfig(device="reference", max_model_len=128, kv_cache_memory=8 << 20, max_num_seqs=4)


class Server:
    def __init__(self, models: dict[str, Path], tmp: Path, device: str = "reference", **pool: Any) -> None:
        base = dataclasses.replace(BASE, device=device)
        self.pool = ModelPool(child_configs(base, models), PoolConfig(**pool))
        self.background = BackgroundServer(build_models_app(self.pool, ServerConfig(disable_ui=True)))

    def __enter__(self) -> httpx.Client:
        self.background.start()
        self.client = httpx.Client(base_url=self.background.url, timeout=120)
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.background.stop(timeout=30)


def _broken(tmp: Path) -> Path:
    path = tmp / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(60))  # the magic, then nothing a GGUF header holds
    return path


@pytest.fixture(scope="module")
def tmp_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def server(tmp_models: Path) -> Iterator[tuple[httpx.Client, ModelPool]]:
    models = {LLAMA: FIXTURES / LLAMA, QWEN: FIXTURES / QWEN, "broken": _broken(tmp_models)}
    with (setup := Server(models, tmp_models)) as client:
        yield client, setup.pool


def _complete(client: httpx.Client, model: Any, ids: list[int], **extra: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 0, **extra})


def _ids(body: dict[str, Any]) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in body["choices"][0]["logprobs"]["tokens"]]


def _states(client: httpx.Client) -> dict[str, str]:
    return {card["id"]: card["status"]["value"] for card in client.get("/v1/models").json()["data"]}


def test_every_model_is_listed_and_answers_with_its_own_greedy_ids_concurrently(
        server: tuple[httpx.Client, ModelPool]) -> None:
    client, _ = server
    assert _states(client) == {LLAMA: "unloaded", QWEN: "unloaded", "broken": "unloaded"}
    cases = [(name, case) for name in (LLAMA, QWEN) for case in GOLDEN[name]] * 2
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: _complete(client, c[0], c[1]["input_ids"]), cases))
    for (name, case), answer in zip(cases, answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == name and _ids(answer.json()) == case["greedy_ids"]
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert cards[LLAMA]["status"] == {"value": "loaded", "error": None} and cards[LLAMA]["max_model_len"] == 128
    assert cards[LLAMA]["root"] == LLAMA  # the directory's name, never the host's path


def test_a_stream_passes_through_whole(server: tuple[httpx.Client, ModelPool]) -> None:
    client, _ = server
    case = GOLDEN[QWEN][1]
    request = {"model": QWEN, "prompt": case["input_ids"], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
               "logprobs": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in (json.loads(e)["choices"][0].get("logprobs") or {}).get("tokens", [])]
    assert [int(t.removeprefix("token_id:")) for t in tokens] == case["greedy_ids"]


@pytest.mark.parametrize("name", ["../tiny_llama", "tiny_llama/", "/tiny_llama", str(FIXTURES / LLAMA),
                                  "file:///etc/passwd", "http://127.0.0.1:1/x", "smollm2-135m-instruct", "TINY_LLAMA"])
def test_a_request_names_only_a_configured_model(server: tuple[httpx.Client, ModelPool], name: str) -> None:
    client, pool = server
    before = {n: (m.state, m.loads) for n, m in pool.models.items()}
    answer = _complete(client, name, [1, 2, 3])
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found" and "'tiny_llama', 'tiny_qwen3'" in answer.text
    assert {n: (m.state, m.loads) for n, m in pool.models.items()} == before  # nothing loaded or read
    messages = client.post("/v1/messages", json={"model": name, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 404 and messages.json()["type"] == "error"  # Anthropic's shape there


def test_a_request_without_a_model_is_told_the_choices(server: tuple[httpx.Client, ModelPool]) -> None:
    client, _ = server
    answer = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "model_required"
    assert _complete(client, 7, [1]).json()["error"]["code"] == "invalid_value"


def test_a_model_that_cannot_load_says_why_and_the_others_keep_serving(server: tuple[httpx.Client, ModelPool]) -> None:
    client, pool = server
    answer = _complete(client, "broken", [1, 2, 3])
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_load_failed"
    message = answer.json()["error"]["message"]
    assert message.startswith("model 'broken' could not be loaded: ") and "broken.gguf" in message, message
    assert "Traceback" not in message
    card = next(c for c in client.get("/v1/models").json()["data"] if c["id"] == "broken")
    assert card["status"]["value"] == "failed" and "broken.gguf" in card["status"]["error"]
    again = _complete(client, "broken", [1])  # within the retry pause: the same answer, no new process
    assert again.status_code == 503 and pool.load_failures["broken"] == 1
    case = GOLDEN[LLAMA][0]
    assert _ids(_complete(client, LLAMA, case["input_ids"]).json()) == case["greedy_ids"]


def test_a_killed_model_is_reported_and_loaded_again_by_the_next_request(
        server: tuple[httpx.Client, ModelPool]) -> None:
    client, pool = server
    case = GOLDEN[LLAMA][1]
    assert _complete(client, LLAMA, case["input_ids"]).status_code == 200
    model = pool.models[LLAMA]
    loads = model.loads
    assert model._process is not None
    os.kill(model._process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _states(client)[LLAMA] != "failed" and time.monotonic() < deadline:
        time.sleep(0.1)
    card = next(c for c in client.get("/v1/models").json()["data"] if c["id"] == LLAMA)
    assert card["status"]["value"] == "failed" and "signal 9" in card["status"]["error"]
    answer = _complete(client, LLAMA, case["input_ids"])
    assert answer.status_code == 200 and _ids(answer.json()) == case["greedy_ids"] and model.loads == loads + 1


def test_metrics_merge_the_models_and_count_loads(server: tuple[httpx.Client, ModelPool]) -> None:
    client, _ = server
    _complete(client, QWEN, [1, 2])
    text = client.get("/metrics").text
    assert 'vllm:num_requests_running{model_name="tiny_qwen3"}' in text
    assert 'vkrt_prompt_tokens_total{model_name="tiny_qwen3"}' in text
    assert text.count("# TYPE vkrt_prompt_tokens_total counter") == 1  # one family, a sample per model
    assert 'vkrt_model_load_failures_total{model_name="broken"} 1.0' in text
    assert "vkrt_models_loaded " in text


def test_the_least_recently_used_idle_model_makes_room(tmp_path: Path) -> None:
    with (setup := Server({LLAMA: FIXTURES / LLAMA, QWEN: FIXTURES / QWEN}, tmp_path, models_max=1)) as client:
        for name in (LLAMA, QWEN, LLAMA):
            case = GOLDEN[name][0]
            answer = _complete(client, name, case["input_ids"])
            assert answer.status_code == 200 and _ids(answer.json()) == case["greedy_ids"]
            assert _states(client) == {name: "loaded", (QWEN if name == LLAMA else LLAMA): "unloaded"}
        assert setup.pool.unloads == {LLAMA: 1, QWEN: 1} and setup.pool.models[LLAMA].loads == 2
        assert client.post("/models/unload", json={"model": LLAMA}).json()["success"] is True
        assert _states(client) == {LLAMA: "unloaded", QWEN: "unloaded"}
        assert client.post("/models/load", json={"model": QWEN}).json()["model"]["status"]["value"] == "loaded"


def test_the_memory_budget_unloads_before_loading(tmp_path: Path) -> None:
    """On the Vulkan device, whose allocator reports what a model reserved (the reference device
    holds no device memory)."""
    if live_model.test_device() != "vulkan":
        pytest.skip("the memory a model takes is measured on a Vulkan device; this machine has none")
    with (setup := Server({LLAMA: FIXTURES / LLAMA, QWEN: FIXTURES / QWEN}, tmp_path, device="vulkan")) as client:
        pool = setup.pool
        assert _complete(client, LLAMA, [1, 2]).status_code == 200
        llama, qwen = pool.models[LLAMA], pool.models[QWEN]
        assert llama.memory_bytes and llama.memory_bytes > 8 << 20  # measured: KV and weights at least
        pool.config.models_memory = llama.memory_bytes + qwen.estimated_bytes() - 1  # not both
        assert _complete(client, QWEN, [1, 2]).status_code == 200
        assert _states(client) == {LLAMA: "unloaded", QWEN: "loaded"}
        pool.config.models_memory = llama.estimated_bytes() - 1  # not even alone
        answer = _complete(client, LLAMA, [1, 2])
        assert answer.status_code == 503 and "--models-memory" in answer.json()["error"]["message"]
        assert _states(client)[QWEN] == "loaded"  # refusing one costs the others nothing


def test_a_busy_model_is_not_unloaded(tmp_path: Path) -> None:
    """With room for one model, a request for the other waits while the first has a request in
    flight (held here through the pool, as a long generation would hold it) and gives up with 503
    model_busy after the load timeout; once the first is idle the other loads in its place."""
    with (setup := Server({LLAMA: FIXTURES / LLAMA, QWEN: FIXTURES / QWEN}, tmp_path, models_max=1)) as client:
        loop = setup.background.server.servers[0].get_loop()
        held = asyncio.run_coroutine_threadsafe(setup.pool.acquire(LLAMA), loop).result()
        setup.pool.config.load_timeout = 1.0  # how long a request waits for room (or a load)
        answer = _complete(client, QWEN, [1])
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_busy"
        assert "tiny_llama" in answer.json()["error"]["message"] and held.state == ModelState.LOADED
        asyncio.run_coroutine_threadsafe(setup.pool.release(held), loop).result()
        setup.pool.config.load_timeout = 120.0
        assert _complete(client, QWEN, [1]).status_code == 200
        assert _states(client) == {LLAMA: "unloaded", QWEN: "loaded"}


def test_models_dir_names_gguf_files_by_stem_and_model_directories_by_name(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    assert model_paths([], tmp_path) == {"a": tmp_path / "a.gguf", "b": tmp_path / "b"}
    assert model_paths([str(FIXTURES / LLAMA)], tmp_path)[LLAMA] == FIXTURES / LLAMA


@pytest.mark.parametrize(("extra", "message"), [
    (["--served-model-name", "x"], "--served-model-name names one model"),
    (["--models-dir", "DUP"], "two models are named 'tiny_llama'"),
    (["--models-dir", "EMPTY"], "holds no model"),
    (["--models-dir", "MISSING"], "not a directory"),
    (["--data-parallel-size", "2", "--data-parallel-backend", "ray"], "--data-parallel-size serves one model"),
    (["--models-max", "0"], "--models-max must be >= 1"),
    (["--kv-events-config", '{"enable_kv_cache_events": true}'], "--kv-events-config publishes one model's"),
])
def test_serving_several_models_refuses_what_names_one(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      extra: list[str], message: str) -> None:
    from vkrt.cli import main

    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / LLAMA).symlink_to(FIXTURES / LLAMA)
    (tmp_path / "empty").mkdir()
    folders = {"DUP": tmp_path / "dup", "EMPTY": tmp_path / "empty", "MISSING": tmp_path / "missing"}
    args = [str(folders.get(a, a)) for a in extra]
    assert main(["serve", "--model", str(FIXTURES / LLAMA), "--model", str(FIXTURES / QWEN), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vkrt: error: ") and message in err and "Traceback" not in err


def test_a_route_without_a_model_is_not_found(server: tuple[httpx.Client, ModelPool]) -> None:
    client, _ = server
    for answer in (client.get("/nothing-here"), client.get("/"), client.post("/v1/completions", content=b"[1]")):
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_the_api_key_guards_the_models_and_reaches_them(tmp_path: Path) -> None:
    """The key is checked in front (Bearer or Anthropic's x-api-key) and holds in each model's own
    server too, which gets it through its config, never its command line."""
    base = dataclasses.replace(BASE, api_key="k3y")
    pool = ModelPool(child_configs(base, {LLAMA: FIXTURES / LLAMA}), PoolConfig())
    front = ServerConfig(disable_ui=True, api_key="k3y")
    with BackgroundServer(build_models_app(pool, front)) as server, httpx.Client(base_url=server.url,
                                                                                  timeout=120) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/health").status_code == 200  # public, as the single server's
        assert _complete(client, LLAMA, [1, 2]).status_code == 401
        assert pool.models[LLAMA].state == ModelState.UNLOADED  # a refused request loads nothing
        client.headers["Authorization"] = "Bearer k3y"
        case = GOLDEN[LLAMA][0]
        assert _ids(_complete(client, LLAMA, case["input_ids"]).json()) == case["greedy_ids"]
        unauthenticated = httpx.post(f"{pool.models[LLAMA].url}/v1/completions", json={"prompt": [1]})
        assert unauthenticated.status_code == 401  # the model's own port wants the key too
        del client.headers["Authorization"]
        messages = client.post("/v1/messages", headers={"x-api-key": "k3y"},
                               json={"model": LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code != 401


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error_on_the_front_routes(tmp_path: Path, mode: str) -> None:
    """The front's own routes (list, card, load, unload, health, metrics) against their OpenAPI
    document: schema-valid bodies answered by the document, schema-breaking ones refused with a
    4xx. The models are configured but the fuzzer's names miss them, so nothing loads."""
    pytest.importorskip("schemathesis", reason="schemathesis is a dev extra (pip install -e .[dev])")
    from schemathesis import GenerationMode

    from tests.server.test_fuzz import API_KEY, fuzz

    pool = ModelPool(child_configs(BASE, {LLAMA: FIXTURES / LLAMA, QWEN: FIXTURES / QWEN}), PoolConfig())
    with BackgroundServer(build_models_app(pool, ServerConfig(disable_ui=True, api_key=API_KEY))) as server:
        statuses = fuzz(server.url, GenerationMode(mode), 40, minimum_operations=6)
    assert sum(statuses.values()) >= 40 and statuses.keys() & {400, 404}, statuses
    assert all(m.loads == 0 for m in pool.models.values())
