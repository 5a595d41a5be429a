"""One configured model of a multi-model server: its `vkrt serve` child process and what is known of it.

A model runs in a process of its own (llama-server's router mode does the same): one Vulkan device
per process, a model's memory is all returned when its process ends, and a model whose load fails
or whose device is lost takes no other model with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import pickle
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from vkrt.engine.config import DEFAULT_KV_BUDGET
from vkrt.errors import VkrtError
from vkrt.server.config import ServerConfig

log = logging.getLogger("vkrt.serve_models")

_STOP_GRACE_S = 10.0  # SIGTERM, then this long before SIGKILL
_PROBE_INTERVAL_S = 0.1


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"


class ModelLoadError(VkrtError):
    """A model's process did not come up: the reason is its own error line."""


class ModelProcess:
    """A model's child process, started on demand and stopped to make room."""

    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name = name
        self.config = config
        self.state = ModelState.UNLOADED
        self.error: str | None = None  # why the last load failed, or why the process ended
        self.failed_at = 0.0
        self.in_flight = 0  # requests forwarded and not yet answered in full
        self.last_used = 0.0
        self.loads = 0
        self.port: int | None = None
        self.max_model_len: int | None = None
        self.memory_bytes: int | None = None  # device memory the engine reserved, once loaded
        self.device_memory_bytes: int | None = None  # the device's memory as the child sees it
        self._process: asyncio.subprocess.Process | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._watch: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def estimated_bytes(self) -> int:
        """Device memory the model will take: what it took when last loaded, else its weights'
        bytes on disk plus the KV cache (and a hybrid's state) budgets, an upper bound."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        config = self.config
        weights = _weights_bytes(Path(str(config.model)))
        kv = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_KV_BUDGET
        return weights + kv

    async def start(self, client: httpx.AsyncClient, timeout: float) -> None:
        """Start the child and wait until it answers GET /ready; ModelLoadError with the child's
        own error line if it exits first or the time runs out."""
        await self.stop()  # what is left of an earlier process that ended on its own
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._stderr_tail.clear()
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "vkrt.serve_models.child", str(listener.fileno()),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                pass_fds=(listener.fileno(),), preexec_fn=_die_with_parent)
        finally:
            listener.close()  # the child holds its own copy
        process = self._process
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(self.config))
        process.stdin.close()
        self._watch = asyncio.ensure_future(self._read_stderr(process))
        deadline = time.monotonic() + timeout
        while True:
            if process.returncode is not None:
                await self._watch
                raise ModelLoadError(self._exit_reason(process.returncode))
            if time.monotonic() > deadline:
                await self.stop()
                raise ModelLoadError(f"model {self.name!r} was not ready within {timeout:g} s "
                                     "(--model-load-timeout)")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{self.url}/ready", timeout=5)).status_code == 200:
                    break
            await asyncio.sleep(_PROBE_INTERVAL_S)
        self.loads += 1
        await self._read_facts(client)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not ended within the grace period."""
        process = self._process
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), _STOP_GRACE_S)
            except asyncio.TimeoutError:
                log.warning("model %r did not stop within %g s of SIGTERM; killing it", self.name, _STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._watch is not None:
            await self._watch
        self._process = None
        self.port = None

    def exited(self) -> str | None:
        """Why the child has ended on its own (crashed, device lost), or None while it runs."""
        process = self._process
        if process is None or process.returncode is None:
            return None
        return self._exit_reason(process.returncode)

    async def _read_facts(self, client: httpx.AsyncClient) -> None:
        """The context length from the child's /v1/models and its memory from its /metrics."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            self.max_model_len = (await client.get(f"{self.url}/v1/models", timeout=5)).json()["data"][0][
                "max_model_len"]
        with contextlib.suppress(httpx.HTTPError, ValueError):
            text = (await client.get(f"{self.url}/metrics", timeout=5)).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "vkrt_device_memory_reserved_bytes" and sample.value > 0:
                        self.memory_bytes = int(sample.value)  # 0 on the reference device: no device memory
                    elif sample.name == "vkrt_device_memory_bytes" and sample.value > 0:
                        self.device_memory_bytes = int(sample.value)

    async def _read_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        async for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._stderr_tail.append(line)
                print(line, file=sys.stderr, flush=True)  # the child's log, on the server's stderr

    def _exit_reason(self, returncode: int) -> str:
        errors = [line.removeprefix("vkrt: error: ") for line in self._stderr_tail if line.startswith("vkrt: error: ")]
        if errors:
            return errors[-1]
        if returncode < 0:
            return f"its process was killed by signal {-returncode}"
        last = self._stderr_tail[-1] if self._stderr_tail else "no output"
        return f"its process exited with status {returncode} ({last})"


def _weights_bytes(path: Path) -> int:
    """A model's bytes on disk: the GGUF file, or an HF directory's safetensors files."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    except OSError:
        return 0


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the server process dies, so a killed server
    leaves no model processes holding device memory (Linux; elsewhere the server's own shutdown
    stops them)."""
    os.setpgrp()  # a Ctrl-C on the server's terminal reaches the server, which stops the children
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

