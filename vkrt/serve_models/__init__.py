"""Several models behind one server: `vkrt serve --model A --model B` or `--models-dir DIR`.

Each model is its own `vkrt serve` process on loopback, started when a request first names it and
stopped, least recently used first, when `--models-max` or the device-memory budget needs room
(llama-server's router mode and Ollama work the same way). This process holds no engine and no
Vulkan device: it lists the models (GET /v1/models, with each one's state), forwards requests by
their `model`, and merges the models' metrics.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from vkrt.errors import VkrtError
from vkrt.serve_models.app import build_models_app
from vkrt.serve_models.catalog import child_configs, model_paths
from vkrt.serve_models.pool import ModelPool, PoolConfig
from vkrt.server.config import ServerConfig
from vkrt.server.http import uvicorn_config
from vkrt.server.webui import page_url

__all__ = ["ModelPool", "PoolConfig", "build_models_app", "child_configs", "model_paths", "serve_models"]

log = logging.getLogger("vkrt.serve_models")


def check_single_model_flags(config: ServerConfig) -> None:
    """Refuse the flags that name one model or bind one port per server: with several models
    each would clash or be ambiguous."""
    if config.served_model_name:
        raise VkrtError("--served-model-name names one model; with several, each is named by its file stem, "
                        "directory name or pulled name")
    if config.kv_events_config is not None:
        raise VkrtError("--kv-events-config publishes one model's cache on one socket; it is not available with "
                        "several models")


def serve_models(config: ServerConfig, models: dict[str, Path], pool_config: PoolConfig) -> None:
    """Listen on config.host:config.port and serve `models` (name -> path) on demand; returns when
    the server stops (Ctrl-C, SIGTERM), after stopping every model's process."""
    import uvicorn

    check_single_model_flags(config)
    pool_config.validate()
    children = child_configs(config, models)
    for child in children.values():
        child.validate()
    config.validate()
    app = build_models_app(ModelPool(children, pool_config), config)
    server = uvicorn.Server(uvicorn_config(app, config, host=config.host, port=config.port,
                                           log_level=config.uvicorn_log_level))
    log.info("serving %d models on http://%s:%d: %s", len(models), config.host, config.port, ", ".join(models))
    if not config.disable_ui:
        print(f"vkrt: chat and status page at {page_url(config.host, config.port)}", file=sys.stderr, flush=True)
    server.run()
