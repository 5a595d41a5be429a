"""Two replicas of the tiny Llama on one local Ray instance, as `vkrt serve --data-parallel-backend ray`
runs them: both serve (HF's greedy ids), a repeated long prompt stays on the replica that cached it,
a killed replica's requests go elsewhere while Ray replaces it, and a stream it was sending ends
with an error event. One Ray instance and one application for the whole module (starting them
takes most of its time)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import FIXTURES
from tests.server import live_model

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'vkrt[ray]')")

from vkrt.errors import VkrtError  # noqa: E402
from vkrt.serve_ray.forward import REPLICA_HEADER  # noqa: E402
from vkrt.serve_ray.ingress import READY_HEADER  # noqa: E402
from vkrt.serve_ray.launch import start_on_ray  # noqa: E402
from vkrt.server import ServerConfig  # noqa: E402

MODEL = FIXTURES / "tiny_llama"
GOLDEN = json.loads((MODEL / "golden.json").read_text())["cases"]
REPLICAS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    from ray import serve

    # Logical CPUs, not cores: the two replicas, and a replacement starting while the dead one's
    # slot is freed.
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    config = ServerConfig(model=MODEL, device=live_model.test_device(), served_model_name="tiny", max_model_len=256,
                          max_num_seqs=4, port=_free_port())
    try:
        url = start_on_ray(config, REPLICAS)
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(client: httpx.Client, prompt: list[int], max_tokens: int = 16) -> tuple[str, dict[str, Any]]:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER], response.json()


def _ids(body: dict[str, Any]) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in body["choices"][0]["logprobs"]["tokens"]]


def _pid(replica: str) -> int:
    return int(replica.rsplit("/", 1)[1])


def _wait_ready(client: httpx.Client, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/health").headers.get(READY_HEADER) == str(count):
            return
        time.sleep(0.2)
    pytest.fail(f"/health did not report {count} ready replicas within {timeout} s: {client.get('/health').text}")


def test_both_replicas_serve_concurrent_requests_with_hf_greedy_ids(client: httpx.Client) -> None:
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["ready_replicas"] == REPLICAS
    assert client.get("/ready").headers[READY_HEADER] == str(REPLICAS) and client.get("/live").status_code == 200
    cases = [case for case in GOLDEN if len(case["input_ids"]) < 16] * 4  # no full block: routed by load
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: _complete(client, case["input_ids"]), cases))
    for case, (_, body) in zip(cases, answers, strict=True):
        assert _ids(body) == case["greedy_ids"]
    replicas = {replica for replica, _ in answers}
    assert len(replicas) == REPLICAS, f"one replica served all {len(cases)} requests: {replicas}"


def test_a_repeated_long_prompt_goes_to_the_replica_that_cached_it(client: httpx.Client) -> None:
    for prompt in (list(range(1, 70)), list(range(100, 169))):  # 4 full blocks of 16 each
        first, body = _complete(client, prompt, max_tokens=2)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # At once: least-loaded routing alone would spread them over both replicas.
        with ThreadPoolExecutor(3) as pool:
            for replica, body in pool.map(lambda same: _complete(client, same, max_tokens=16), [prompt] * 3):
                assert replica == first
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_a_stream_from_a_killed_replica_ends_with_an_error_event(client: httpx.Client) -> None:
    request = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 240, "temperature": 0, "ignore_eos": True,
               "stream": True}
    events: list[str] = []
    with client.stream("POST", "/v1/completions", json=request) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        os.kill(_pid(stream.headers[REPLICA_HEADER]), signal.SIGKILL)
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] != "data: [DONE]", "the stream finished before the replica was killed"
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "replica_lost" and "stopped" in error["message"]
    _wait_ready(client, REPLICAS - 1, timeout=15)
    _wait_ready(client, REPLICAS)  # Ray replaced it


def test_a_replica_killed_while_idle_is_routed_around_and_replaced(client: httpx.Client) -> None:
    victim, _ = _complete(client, [7], max_tokens=1)
    os.kill(_pid(victim), signal.SIGKILL)
    # Sent at once, before Ray has noticed: those routed to the dead replica are sent again.
    with ThreadPoolExecutor(6) as pool:
        answers = pool.map(lambda case: _complete(client, case["input_ids"]), GOLDEN * 2)
        _wait_ready(client, REPLICAS - 1, timeout=15)
        survivors = set()
        for case, (replica, body) in zip(GOLDEN * 2, answers, strict=True):
            assert replica != victim and _ids(body) == case["greedy_ids"]
            survivors.add(replica)
    _wait_ready(client, REPLICAS)
    # The replacement serves once the ingress's router has heard of it (a moment after /health).
    deadline = time.monotonic() + 20
    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline:
            replicas = {replica for replica, _ in pool.map(lambda _: _complete(client, [7], 8), range(4))}
            assert victim not in replicas
            if replicas - survivors:
                return
    pytest.fail(f"no request reached the replacement replica; only {survivors} answered")


def test_app_builder_takes_serve_run_strings_and_config_file_mappings() -> None:
    from vkrt.serve_ray import app_builder

    app_builder({"model": str(MODEL), "num_replicas": "2", "max_model_len": "64", "enable_replay": "false"})
    app_builder({"model": str(MODEL), "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})
    with pytest.raises(VkrtError, match="unknown argument.*max_model_length"):
        app_builder({"model": str(MODEL), "max_model_length": 64})
    with pytest.raises(VkrtError, match="max_num_seqs='many': expected int"):
        app_builder({"model": str(MODEL), "max_num_seqs": "many"})
    with pytest.raises(VkrtError, match="--data-parallel-size must be >= 1"):
        app_builder({"model": str(MODEL), "num_replicas": 0})


def test_data_parallel_flags_need_the_ray_backend(capsys: pytest.CaptureFixture[str]) -> None:
    from vkrt.cli import main

    assert main(["serve", "--model", str(MODEL), "--data-parallel-size", "2"]) == 1
    assert "need --data-parallel-backend ray" in capsys.readouterr().err


def _router(imbalance: int = 4) -> Any:
    """A PrefixAffinityRouter without Ray's routing machinery (only the policy's own state)."""
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    from vkrt.serve_ray.router import PrefixAffinityRouter

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router.initialize_state(imbalance=imbalance)
    return router


def _pending(prompt: list[int]) -> Any:
    from types import SimpleNamespace

    from vkrt.serve_ray.forward import ForwardedRequest, block_hashes

    request = ForwardedRequest("POST", "/v1/completions", b"", (), b"", block_hashes(prompt, 16))
    return SimpleNamespace(args=[request], routing_context=SimpleNamespace(should_backoff=False))


def test_the_router_prefers_the_replica_holding_the_longest_prefix_unless_it_is_much_busier() -> None:
    import asyncio
    from types import SimpleNamespace

    router = _router(imbalance=4)
    first, second = (SimpleNamespace(replica_id=name, routing_stats={}) for name in ("first", "second"))
    shared, other = list(range(1, 49)), list(range(200, 248))  # 3 full blocks each
    for prompt, replica in ((shared[:32], "first"), (shared, "second"), (other, "first")):
        router.on_request_routed(_pending(prompt), replica, None)
        router.on_request_completed(replica, "done")

    def choose(prompt: list[int]) -> list[list[str]]:
        ranks = asyncio.run(router.choose_replicas([first, second], _pending(prompt)))
        return [sorted(r.replica_id for r in rank) for rank in ranks]  # a rank's order is shuffled

    assert choose(shared + [7] * 16) == [["second"], ["first", "second"]]  # 3 blocks held beat 2
    assert choose(other) == [["first"], ["first", "second"]]
    assert choose(list(range(500, 548))) == [["first", "second"]]  # nobody holds it: by load alone
    assert choose([1, 2, 3]) == [["first", "second"]]  # no full block
    second.routing_stats = {"running": 4, "waiting": 1}  # 5 more than the idle first: over the imbalance
    assert choose(shared) == [["first"], ["second"]]
    second.routing_stats = {"running": 4, "waiting": 0}
    assert choose(shared) == [["second"], ["first"], ["second"]]


def test_the_router_counts_what_it_sent_and_shuffles_replicas_of_equal_load() -> None:
    """Requests routed but not finished count as load before the engine reports them, and equal
    loads come in either order: requests routed together on one stale probe must not all take the
    first replica (CI once saw 8 concurrent requests on one of two idle replicas)."""
    import asyncio
    from types import SimpleNamespace

    router = _router()
    replicas = [SimpleNamespace(replica_id=name, routing_stats={}) for name in ("first", "second")]

    def choose() -> list[list[str]]:
        return [[r.replica_id for r in rank] for rank in asyncio.run(router.choose_replicas(replicas, _pending([1])))]

    router.on_request_routed(_pending([1]), "first", None)
    assert choose() == [["second"], ["first"]]
    router.on_request_routed(_pending([1]), "second", None)
    router.on_request_completed("first", "a")
    assert choose() == [["first"], ["second"]]
    router.on_request_completed("second", "b")
    router.on_request_completed("second", "late")  # never below zero
    orders = {tuple(choose()[0]) for _ in range(64)}
    assert orders == {("first", "second"), ("second", "first")}
