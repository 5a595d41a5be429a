"""Data-parallel replicas on Ray Serve: N engines (one device each) behind one set of OpenAI routes.

The application is two deployments: `vkrt-ingress` (HTTP; forwards, answers /health) and
`vkrt-engine` (one AsyncLLM and vkrt's own app per replica), routed by PrefixAffinityRouter.
`vkrt serve --data-parallel-backend ray` runs it (launch.py); `serve run vkrt.serve_ray:app_builder
model=PATH num_replicas=2` and Ray Serve config files import `app_builder` (docs/USAGE.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ray import serve

from vkrt.errors import VkrtError
from vkrt.serve_ray.ingress import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, Ingress
from vkrt.serve_ray.replica import EngineReplica
from vkrt.serve_ray.router import PrefixAffinityRouter
from vkrt.server import ServerConfig

__all__ = ["app_builder", "build_application"]

# How often each replica reports its engine's running + waiting to the routers (seconds).
ROUTING_STATS_PERIOD_S = 2.0
# ServerConfig fields an app_builder argument may set: the scalar ones (strings from `serve run`
# are converted by the field's type).
_SCALAR_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(ServerConfig)
                  if not any(kind in str(f.type) for kind in ("Config", "tuple"))}
_APP_ARGS = ("num_replicas", "devices", "replica_cpus", "autoscaling_config")


def build_application(config: ServerConfig, num_replicas: int = 1, devices: tuple[str, ...] = (),
                      replica_cpus: float = 1.0, autoscaling_config: Mapping[str, Any] | None = None,
                      ) -> serve.Application:
    """The Ray Serve application of `num_replicas` engines under `config` (or as many as Ray Serve's
    `autoscaling_config` asks for: it scales on requests in flight per replica, the engine's
    running + waiting); replica r on a node takes `devices[r % len(devices)]` (a VKRT_DEVICE
    selector) when devices are given."""
    config.validate()
    if num_replicas < 1:
        raise VkrtError(f"--data-parallel-size must be >= 1, got {num_replicas}")
    if config.kv_events_config is not None and (num_replicas > 1 or autoscaling_config is not None):
        raise VkrtError("--kv-events-config takes one endpoint, which replicas cannot share; "
                        "publish KV events from single-engine servers")
    if replica_cpus < 0:
        raise VkrtError(f"replica_cpus must be >= 0, got {replica_cpus}")
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        num_replicas=None if autoscaling_config is not None else num_replicas,
        autoscaling_config=dict(autoscaling_config) if autoscaling_config is not None else None,
        # A replica holds a running batch and as many waiting, so it never idles between steps; the
        # rest wait in the router, free to go to whichever replica has room first.
        max_ongoing_requests=2 * config.max_num_seqs,
        request_router_config={"request_router_class": PrefixAffinityRouter,
                               "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S},
        ray_actor_options={"num_cpus": replica_cpus},
        health_check_period_s=5.0,
        max_constructor_retry_count=2,  # a model that fails to load fails the same way again
    )(EngineReplica)
    ingress = serve.deployment(name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=config.limit_concurrency)(Ingress)
    return ingress.bind(engine.bind(config, tuple(devices)), config)


def app_builder(args: Mapping[str, Any]) -> serve.Application:
    """The application for `serve run vkrt.serve_ray:app_builder KEY=VALUE ...` and config files'
    `import_path`: ServerConfig's scalar fields (model, max_model_len, ...), plus num_replicas,
    devices (a list, or comma-separated), replica_cpus and autoscaling_config (a mapping)."""
    unknown = sorted(set(args) - set(_SCALAR_FIELDS) - set(_APP_ARGS))
    if unknown:
        raise VkrtError(f"vkrt.serve_ray:app_builder: unknown argument(s) {', '.join(unknown)}; "
                        f"give {', '.join((*_APP_ARGS, *sorted(_SCALAR_FIELDS)))}")
    fields = {name: _coerce(name, value, _SCALAR_FIELDS[name]) for name, value in args.items()
              if name in _SCALAR_FIELDS}
    devices = args.get("devices", ())
    if isinstance(devices, str):
        devices = tuple(d.strip() for d in devices.split(",") if d.strip())
    autoscaling = args.get("autoscaling_config")
    if autoscaling is not None and not isinstance(autoscaling, Mapping):
        raise VkrtError("vkrt.serve_ray:app_builder: autoscaling_config must be a mapping (give it in a config file)")
    return build_application(ServerConfig(**fields),
                             num_replicas=_coerce("num_replicas", args.get("num_replicas", 1), "int"),
                             devices=tuple(str(d) for d in devices),
                             replica_cpus=_coerce("replica_cpus", args.get("replica_cpus", 1.0), "float"),
                             autoscaling_config=autoscaling)


def _coerce(name: str, value: Any, annotation: str) -> Any:
    if not isinstance(value, str) or "str" in annotation:
        return value
    try:
        if "bool" in annotation:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if "int" in annotation:
            return int(value)
        if "float" in annotation:
            return float(value)
    except ValueError:
        raise VkrtError(f"vkrt.serve_ray:app_builder: {name}={value!r}: expected {annotation}") from None
    return value
