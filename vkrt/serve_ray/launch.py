"""`vkrt serve --data-parallel-backend ray`: start (or join) Ray, run the application, wait."""

from __future__ import annotations

import logging
import sys
import time

import ray
from ray import serve

from vkrt.errors import VkrtError
from vkrt.serve_ray import build_application
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
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            raise VkrtError(f"cannot start or join {where}: {exc}") from exc
    serve.start(http_options={"host": config.host, "port": config.port})
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:  # Ray Serve gave up on a replica (the model failed to load, ...)
        raise VkrtError(f"the replicas did not start: {exc}") from exc
    return f"http://{config.host}:{config.port}"


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
