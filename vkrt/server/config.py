"""Server configuration: one dataclass built at the edge (CLI flags) and validated there."""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

from vkrt import config as env
from vkrt.engine.config import EngineConfig
from vkrt.engine.kv_events import KVEventsConfig
from vkrt.engine.pooling import POOLING_METHODS
from vkrt.engine.speculative import SpeculativeConfig
from vkrt.errors import VkrtError

# Routes that answer without the API key: load balancers and probes call them.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/live", "/version"})


# The syntaxes vkrt/server/tools.py parses (named here so the config does not import the server).
TOOL_CALL_PARSERS = ("hermes", "qwen3_xml", "seed_oss", "llama3_json", "mistral", "harmony")
REASONING_PARSERS = ("auto", "think", "seed_oss", "harmony", "none")
RERANKERS = ("yes-no",)  # --reranker: how a causal LM scores (vkrt/server/pooling.py)


@dataclass
class ServerConfig:
    """How `vkrt serve` listens, what it calls the model, and the engine it builds."""

    model: str | Path | None = None  # None: the default model (pulled like `vkrt generate`)
    device: str = "auto"  # "auto" | "vulkan" | "reference"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every route but PUBLIC_PATHS needs "Authorization: Bearer <key>"
    public_metrics: bool = False  # GET /metrics answers without the key (for scrapers)
    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*": any); empty: no CORS headers
    served_model_name: str | None = None  # None: the model file or directory name
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None  # bytes
    state_memory: int | None = None  # bytes for a hybrid's recurrent state (--state-memory)
    state_snapshot_memory: int | None = None  # bytes for its prefix-cache state snapshots (--state-snapshot-memory)
    kv_dtype: str = "f16"  # KV cache element type (--kv-cache-dtype)
    enable_log_requests: bool = False
    max_log_len: int | None = None  # prompt characters/ids logged per request; None: all
    disable_metrics: bool = False
    disable_ui: bool = False  # no chat and status page at / (--disable-ui): / answers 404
    enable_replay: bool = True  # replay recorded decode steps (vkrt serve --no-replay turns it off)
    speculative_config: SpeculativeConfig | None = None  # --speculative-config
    check_tensors: bool | None = None  # --check-tensors; None: VKRT_CHECK_TENSORS
    kv_events_config: KVEventsConfig | None = None  # --kv-events-config (None: no events published)
    pipeline_parallel_size: int = 1  # --pipeline-parallel-size: the layers over this many stage processes
    pipeline_devices: tuple[str, ...] = ()  # --pipeline-devices: each stage's VKRT_DEVICE selector
    pipeline_micro_batches: int | None = None  # --pipeline-micro-batches (None: one per stage)
    distributed_executor_backend: str = "mp"  # --distributed-executor-backend: the stages' processes or Ray actors
    ray_address: str | None = None  # --ray-address: the Ray cluster (of replicas or of "ray" stages)
    # Requests accepted beyond max_num_seqs before answering 429 (the engine's waiting queue).
    max_waiting_requests: int = 256
    max_request_body_bytes: int = 8 * 1024 * 1024  # larger bodies get 413
    # Prompt text (a completion prompt, the messages' text, a rendered chat prompt) longer than
    # this gets 413 before it is tokenised: 1 Mi characters tokenise in about a second.
    max_prompt_chars: int = 1 << 20
    chat_template_timeout: float = 2.0  # seconds one chat-template rendering may take
    escape_special_tokens: bool = False  # message content tokenised as text, never as control tokens
    tool_call_parser: str | None = None  # None: picked from the chat template (server/tools.py)
    # reasoning_content: auto (by template), think (<think> tags), seed_oss (<seed:think> tags),
    # harmony (gpt-oss channels), none
    reasoning_parser: str = "auto"
    # Digits an integer (or a number's integer part) may have under a JSON-schema constraint
    # or a forced tool call when the schema sets no bounds (--json-max-digits; 0: unbounded).
    json_max_digits: int = 16
    pooling: str | None = None  # --pooling: embeddings' pooling method; None: the model's own, else last token
    reranker: str | None = None  # --reranker yes-no: score with a causal LM's yes/no logits (Qwen3-Reranker)
    cpu_workers: int = 2  # threads that tokenise and render templates off the event loop (niced)
    # Connection limits (uvicorn/h11 underneath).
    timeout_keep_alive: float = 5.0  # idle keep-alive connections are closed after this
    timeout_read: float = 10.0  # a request head, and then its body, must arrive within this
    limit_concurrency: int = 512  # open connections + requests in progress; beyond it 503
    max_header_bytes: int = 16 * 1024  # request line + headers; larger gets 431
    uvicorn_log_level: str = "info"

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise VkrtError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests < 0:
            raise VkrtError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise VkrtError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        for name, value in (("max_request_body_bytes", self.max_request_body_bytes),
                            ("--max-prompt-chars", self.max_prompt_chars), ("cpu_workers", self.cpu_workers),
                            ("--limit-concurrency", self.limit_concurrency),
                            ("--max-header-bytes", self.max_header_bytes)):
            if value < 1:
                raise VkrtError(f"{name} must be >= 1, got {value}")
        for name, seconds in (("--timeout-keep-alive", self.timeout_keep_alive),
                              ("--timeout-read", self.timeout_read),
                              ("--chat-template-timeout", self.chat_template_timeout)):
            if not seconds > 0:
                raise VkrtError(f"{name} must be > 0 seconds, got {seconds}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise VkrtError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                            f"got {self.tool_call_parser!r}")
        if not 0 <= self.json_max_digits <= 18:
            raise VkrtError(f"--json-max-digits must be in [0, 18] (0: unbounded), got {self.json_max_digits}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise VkrtError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                            f"got {self.reasoning_parser!r}")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise VkrtError(f"--pooling must be one of {', '.join(POOLING_METHODS)}, got {self.pooling!r}")
        if self.reranker is not None and self.reranker not in RERANKERS:
            raise VkrtError(f"--reranker must be one of {', '.join(RERANKERS)}, got {self.reranker!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise VkrtError("the API key is empty; give a non-empty key or none")
        check_model_path(self.model)
        self.engine_config().validate()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model or "",
            device=self.device,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory=self.kv_cache_memory,
            state_memory=self.state_memory,
            state_snapshot_memory=self.state_snapshot_memory,
            kv_dtype=self.kv_dtype,
            enable_replay=self.enable_replay,
            speculative=self.speculative_config,
            check_tensors=self.check_tensors,
            kv_events=self.kv_events_config,
            pipeline_parallel_size=self.pipeline_parallel_size,
            pipeline_devices=self.pipeline_devices,
            pipeline_micro_batches=self.pipeline_micro_batches,
            distributed_executor_backend=self.distributed_executor_backend,
            ray_address=self.ray_address,
        )

    def max_digits(self) -> int | None:
        """GuidedDecoding.max_digits for the schemas this server compiles (None: unbounded)."""
        return self.json_max_digits or None

    def model_name(self) -> str:
        """The id clients send as `model` (and see in /v1/models)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            path = Path(self.model)
            return path.stem if path.suffix == ".gguf" else path.name
        from vkrt.loader.pull import DEFAULT_MODEL

        return DEFAULT_MODEL


def check_model_path(model: str | Path | None) -> None:
    """Refuse a --model that exists but is neither a regular file nor a directory: opening a
    FIFO or a device would block or read forever."""
    if not model:
        return
    path = Path(model)
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # missing: the loader says so (or it names a model to pull)
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise VkrtError(f"--model {path}: not a regular file or directory; give a .gguf file or an HF model directory")


def resolve_api_key(flag: str | None, key_file: str | Path | None) -> str | None:
    """The API key from --api-key, else --api-key-file (first line), else VKRT_API_KEY."""
    if flag is not None:
        return flag
    if key_file is not None:
        path = Path(key_file)
        try:
            if not path.is_file():
                raise VkrtError(f"--api-key-file {path}: not a regular file")
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise VkrtError(f"--api-key-file {path}: cannot be read ({exc})") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            raise VkrtError(f"--api-key-file {path}: the file is empty")
        return key
    return env.api_key()
