"""deploy/ is checked offline as far as the tools allow: every YAML parses, kustomize renders
it, the probes name routes the server has, and the pieces name each other consistently (pool
selector and pod labels, ports, the KV-event endpoint and the picker's socket, block size)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute

from vkrt.engine.config import EngineConfig
from vkrt.engine.kv_events import KVEventsConfig
from vkrt.server import ServerConfig, build_app

yaml = pytest.importorskip("yaml", reason="PyYAML (installed with gguf) parses the manifests")

DEPLOY = Path(__file__).parents[1] / "deploy"
K8S = DEPLOY / "k8s"


def documents() -> dict[str, list[dict[str, Any]]]:
    return {path.name: [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
            for path in sorted(DEPLOY.rglob("*.yaml"))}


def by_kind(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for docs in documents().values() for d in docs
              if d.get("kind") == kind and d["metadata"]["name"] == name]
    return doc


def served_get_paths() -> set[str]:
    app = build_app(None, ServerConfig(served_model_name="x"))
    return {route.path for route in app.routes if isinstance(route, APIRoute) and "GET" in route.methods}


def test_every_yaml_parses_and_is_a_kubernetes_object() -> None:
    docs = documents()
    assert len(docs) >= 7
    for name, objects in docs.items():
        assert objects, f"{name} is empty"
        for obj in objects:
            assert {"apiVersion", "kind"} <= set(obj), f"{name}: an object without apiVersion/kind"
    kustomization = docs["kustomization.yaml"][0]
    listed = set(kustomization["resources"]) | {f for g in kustomization["configMapGenerator"] for f in g["files"]}
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: kustomize render not checked")
def test_kustomize_renders() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered.stdout)}
    assert {"Deployment", "InferencePool", "ConfigMap", "Service", "HTTPRoute", "Gateway"} <= kinds


def test_probes_point_at_routes_the_server_has() -> None:
    routes = served_get_paths()
    (container,) = by_kind("Deployment", "vkrt")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready" and probes["livenessProbe"]["path"] == "/live"
    for kind, probe in probes.items():
        assert probe["path"] in routes, f"{kind} probes {probe['path']}, which the server does not serve"
        assert probe["port"] in ports
    healthcheck = re.search(r"HEALTHCHECK .*(http://[^']+)", (DEPLOY / "Containerfile").read_text())
    assert healthcheck is not None and healthcheck.group(1).rsplit(":8000", 1)[1] in routes


def test_the_pool_the_picker_and_the_pods_agree() -> None:
    pool = by_kind("InferencePool", "vkrt-pool")["spec"]
    pods = by_kind("Deployment", "vkrt")["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= pods["metadata"]["labels"].items()
    (container,) = pods["spec"]["containers"]
    assert [p["number"] for p in pool["targetPorts"]] == [p["containerPort"] for p in container["ports"]]
    service = by_kind("Service", "vkrt-epp")["spec"]
    service_ports = {p["port"] for p in service["ports"]}
    assert pool["endpointPickerRef"]["name"] == "vkrt-epp"
    assert pool["endpointPickerRef"]["port"]["number"] in service_ports

    # The pods' --kv-events-config is valid and connects to the picker's bound KV-event socket.
    args = container["args"]
    text = args[args.index("--kv-events-config") + 1].replace("$(POD_IP)", "10.0.0.1")
    events = KVEventsConfig.parse(text)
    assert events is not None and events.endpoint == "tcp://vkrt-epp:5557" and 5557 in service_ports
    (picker_config,) = documents()["epp-config.yaml"]
    (scorer,) = [p for p in picker_config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    assert scorer["parameters"]["kvEventsConfig"]["zmqEndpoint"].endswith(":5557")
    assert events.topic.startswith(scorer["parameters"]["kvEventsConfig"]["topicFilter"])
    assert scorer["parameters"]["indexerConfig"]["tokenProcessorConfig"]["blockSize"] == EngineConfig().block_size
    refs = [p["pluginRef"] for profile in picker_config["schedulingProfiles"] for p in profile["plugins"]]
    assert set(refs) == {p["type"] for p in picker_config["plugins"]}
    json.loads(text)  # the flag's value is plain JSON (no YAML-only syntax leaked in)
