"""Server configuration: one dataclass built at the edge (CLI flags) and validated there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vkrt.engine.config import EngineConfig
from vkrt.errors import VkrtError


@dataclass
class ServerConfig:
    """How `vkrt serve` listens, what it calls the model, and the engine it builds."""

    model: str | Path | None = None  # None: the default model (pulled like `vkrt generate`)
    device: str = "auto"  # "auto" | "vulkan" | "reference"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* need "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # None: the model file or directory name
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None  # bytes
    enable_log_requests: bool = False
    max_log_len: int | None = None  # prompt characters/ids logged per request; None: all
    disable_metrics: bool = False
    enable_replay: bool = True  # replay recorded decode steps (vkrt serve --no-replay turns it off)
    # Requests accepted beyond max_num_seqs before answering 429 (the engine's waiting queue).
    max_waiting_requests: int = 256
    max_request_body_bytes: int = 8 * 1024 * 1024  # larger bodies get 413
    uvicorn_log_level: str = "info"

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise VkrtError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests < 0:
            raise VkrtError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise VkrtError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.max_request_body_bytes < 1:
            raise VkrtError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        self.engine_config().validate()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model or "",
            device=self.device,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory=self.kv_cache_memory,
            enable_replay=self.enable_replay,
        )

    def model_name(self) -> str:
        """The id clients send as `model` (and see in /v1/models)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            path = Path(self.model)
            return path.stem if path.suffix == ".gguf" else path.name
        from vkrt.loader.pull import DEFAULT_MODEL

        return DEFAULT_MODEL
