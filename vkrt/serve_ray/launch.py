"""`vkrt serve --data-parallel-backend ray`: start (or join) Ray, run the application, wait."""

from __future__ import annotations

import logging
import os
import sys
import time

import ray
from ray import serve

from vkrt.errors import VkrtError
from vkrt.serve_ray import build_application
from vkrt.serve_ray.ingress import ENGINE_DEPLOYMENT
from vkrt.server import ServerConfig

log = logging.getLogger("vkrt.serve_ray")

APP_NAME = "vkrt"


def start_on_ray(config: ServerConfig, num_replicas: int, address: str | None = None,
                 devices: tuple[str, ...] = ()) -> str:
    """Run the application on the Ray cluster at `address` (None: a local instance, unless this
    process is already connected) with HTTP on config.host:config.port; returns once every replica
    is ready, with the application's URL."""
    app = build_application(config, num_replicas=num_replicas, devices=devices)
    if not ray.is_initialized():
        try:
            # A local instance offers at least one CPU per replica (each reserves one): on a small
            # machine whose engines run on GPUs, a replica beyond the core count would wait forever.
            joining = address or os.environ.get("RAY_ADDRESS")  # (Ray reads RAY_ADDRESS itself)
            local_cpus = None if joining else max(os.cpu_count() or 1, num_replicas)
            ray.init(address=address, num_cpus=local_cpus, logging_level=logging.WARNING)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            raise VkrtError(f"cannot start or join {where}: {exc}") from exc
    serve.start(http_options={"host": config.host, "port": config.port})
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:  # Ray Serve gave up on a replica (the model failed to load, ...)
        failure = _replica_failure()
        serve.delete(APP_NAME)  # on a shared cluster, leave no failed application behind
        raise VkrtError(f"the replicas did not start: {failure or exc}") from exc
    return f"http://{config.host}:{config.port}"


def _replica_failure() -> str | None:
    """The last line of the engine deployment's status message: the error a replica's constructor
    raised (Ray Serve's own message names only the deployment)."""
    application = serve.status().applications.get(APP_NAME)
    deployment = application.deployments.get(ENGINE_DEPLOYMENT) if application is not None else None
    lines = [line.strip() for line in (deployment.message if deployment is not None else "").splitlines()]
    return next((line for line in reversed(lines) if line), None)


def serve_on_ray(config: ServerConfig, num_replicas: int, address: str | None = None,
                 devices: tuple[str, ...] = ()) -> None:
    """start_on_ray, then serve until interrupted; the application is deleted on the way out (a
    local Ray instance stops with this process)."""
    url = start_on_ray(config, num_replicas, address, devices)
    print(f"vkrt: {num_replicas} replica(s) of {config.model_name()} on Ray Serve at {url}", file=sys.stderr,
          flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        serve.delete(APP_NAME)
