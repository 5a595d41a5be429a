"""The models of a multi-model server: loaded on first use, unloaded least recently used first.

At most `models_max` models are loaded at once, and their device memory stays within
`models_memory` (by default 90% of the device's memory, as the first loaded model reports it).
A model is measured once loaded (the engine's reserved bytes) and estimated before (weights on
disk plus the KV budget). To load one, idle models are unloaded, least recently used first; a model
with requests in flight is never unloaded, so a load waits for one to go idle, up to the load
timeout. A model whose load failed answers with that error for `RETRY_AFTER_S`, then is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from vkrt.errors import VkrtError
from vkrt.serve_models.process import ModelLoadError, ModelProcess, ModelState
from vkrt.server.config import ServerConfig

log = logging.getLogger("vkrt.serve_models")

RETRY_AFTER_S = 5.0
DEVICE_MEMORY_SHARE = 0.9  # of the device's memory, the default budget for all loaded models


@dataclass
class PoolConfig:
    models_max: int = 4  # --models-max
    models_memory: int | None = None  # --models-memory bytes; None: DEVICE_MEMORY_SHARE of the device's
    load_timeout: float = 600.0  # --model-load-timeout seconds

    def validate(self) -> None:
        if self.models_max < 1:
            raise VkrtError(f"--models-max must be >= 1, got {self.models_max}")
        if self.models_memory is not None and self.models_memory < 1:
            raise VkrtError(f"--models-memory must be > 0, got {self.models_memory}")
        if not self.load_timeout > 0:
            raise VkrtError(f"--model-load-timeout must be > 0 seconds, got {self.load_timeout}")


class ModelBusy(VkrtError):
    """No room to load a model while the loaded ones all have requests in flight."""


class ModelPool:
    def __init__(self, configs: dict[str, ServerConfig], config: PoolConfig) -> None:
        self.models = {name: ModelProcess(name, child) for name, child in configs.items()}
        self.config = config
        self.unloads: dict[str, int] = dict.fromkeys(self.models, 0)
        self.load_failures: dict[str, int] = dict.fromkeys(self.models, 0)
        self._changed = asyncio.Condition()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._device_memory: int | None = None

    @property
    def budget(self) -> int | None:
        """Device bytes all loaded models may take together (None: unknown yet, no limit)."""
        if self.config.models_memory is not None:
            return self.config.models_memory
        return int(self._device_memory * DEVICE_MEMORY_SHARE) if self._device_memory else None

    @property
    def client(self) -> httpx.AsyncClient:
        return self._client

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[ModelProcess]:
        """The model, loaded, with one more request counted in flight while the caller holds it."""
        model = await self.acquire(name)
        try:
            yield model
        finally:
            await self.release(model)

    async def acquire(self, name: str) -> ModelProcess:
        """Load `name` if needed (unloading idle models to make room) and count a request on it.
        ModelLoadError if it cannot be loaded, ModelBusy if no room frees up in time."""
        model = self.models[name]
        deadline = time.monotonic() + self.config.load_timeout
        while True:
            async with self._changed:
                victims = await self._claim(model, deadline)
                if victims is None:  # loaded: take it
                    model.in_flight += 1
                    model.last_used = time.monotonic()
                    return model
            await self._load(model, victims)

    async def release(self, model: ModelProcess) -> None:
        async with self._changed:
            model.in_flight -= 1
            model.last_used = time.monotonic()
            self._changed.notify_all()

    async def load(self, name: str) -> ModelProcess:
        """Load `name` without sending it a request (POST /models/load)."""
        model = await self.acquire(name)
        await self.release(model)
        return model

    async def unload(self, name: str) -> bool:
        """Unload `name` once its requests in flight have finished; False if it was not loaded."""
        model = self.models[name]
        async with self._changed:
            while model.state in (ModelState.LOADING, ModelState.UNLOADING) or (
                    model.state == ModelState.LOADED and model.in_flight):
                await self._changed.wait()
            if model.state != ModelState.LOADED:
                return False
            model.state = ModelState.UNLOADING
        await self._stop(model, "request")
        return True

    async def close(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.models.values() if m.state != ModelState.UNLOADED),
                             return_exceptions=True)
        await self._client.aclose()

    async def _claim(self, model: ModelProcess, deadline: float) -> list[ModelProcess] | None:
        """Under the lock: None when `model` is loaded and can be taken; else the models to unload
        first, with `model` marked LOADING and each of them UNLOADING (waits while another request
        loads it or while the loaded models are all busy)."""
        while True:
            self._notice_exits()
            if model.state == ModelState.LOADED:
                return None
            if model.state == ModelState.FAILED and time.monotonic() - model.failed_at < RETRY_AFTER_S:
                raise ModelLoadError(f"model {model.name!r} could not be loaded: {model.error}")
            if model.state in (ModelState.UNLOADED, ModelState.FAILED):
                victims = self._room_for(model)
                if victims is not None:
                    model.state = ModelState.LOADING
                    for victim in victims:
                        victim.state = ModelState.UNLOADING
                    return victims
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._busy(model) if model.state != ModelState.LOADING else ModelLoadError(
                    f"model {model.name!r} is still loading; retry")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _room_for(self, model: ModelProcess) -> list[ModelProcess] | None:
        """The idle models to unload, least recently used first, so that `model` fits the count
        and the memory budget; None while that needs a busy one."""
        need = model.estimated_bytes()
        budget = self.budget
        if budget is not None and need > budget:
            raise ModelLoadError(f"model {model.name!r} needs about {need / 2**30:.2f} GiB of device memory, over "
                                 f"the {budget / 2**30:.2f} GiB all loaded models may take (--models-memory)")
        held = [m for m in self.models.values()
                if m is not model and m.state in (ModelState.LOADED, ModelState.LOADING, ModelState.UNLOADING)]
        idle = sorted((m for m in held if m.state == ModelState.LOADED and m.in_flight == 0),
                      key=lambda m: m.last_used)
        # UNLOADING models are on their way out: they count until they are gone.
        victims: list[ModelProcess] = []
        while True:
            kept = [m for m in held if m not in victims]
            used = sum(m.estimated_bytes() for m in kept)
            if len(kept) < self.config.models_max and (budget is None or used + need <= budget):
                return victims
            candidates = [m for m in idle if m not in victims]
            if not candidates:
                return None
            victims.append(candidates[0])

    async def _load(self, model: ModelProcess, victims: list[ModelProcess]) -> None:
        """Outside the lock: unload the victims, then start `model`."""
        try:
            for victim in victims:
                await self._stop(victim, "room")
            log.info("loading model %r", model.name)
            await model.start(self._client, self.config.load_timeout)
        except ModelLoadError as exc:
            log.warning("model %r could not be loaded: %s", model.name, exc)
            async with self._changed:
                model.state, model.error, model.failed_at = ModelState.FAILED, str(exc), time.monotonic()
                self.load_failures[model.name] += 1
                self._changed.notify_all()
            raise ModelLoadError(f"model {model.name!r} could not be loaded: {exc}") from exc
        except BaseException:
            await model.stop()
            async with self._changed:
                model.state = ModelState.UNLOADED
                self._changed.notify_all()
            raise
        async with self._changed:
            model.state, model.error = ModelState.LOADED, None
            if self._device_memory is None and model.device_memory_bytes:
                self._device_memory = model.device_memory_bytes
            self._changed.notify_all()
        log.info("model %r loaded (%s device bytes)", model.name, model.memory_bytes)

    async def _stop(self, model: ModelProcess, reason: str) -> None:
        log.info("unloading model %r (%s)", model.name, reason)
        await model.stop()
        async with self._changed:
            model.state = ModelState.UNLOADED
            self.unloads[model.name] += 1
            self._changed.notify_all()

    def refresh(self) -> None:
        """Take note of models whose process has ended (for listings between requests)."""
        self._notice_exits()

    def _notice_exits(self) -> None:
        """A loaded model whose process ended on its own (crash, lost device) is failed, with why."""
        for m in self.models.values():
            reason = m.exited() if m.state == ModelState.LOADED else None
            if reason is not None:
                log.warning("model %r stopped: %s", m.name, reason)
                # failed_at 0: the next request reloads it at once
                m.state, m.error, m.failed_at = ModelState.FAILED, f"its server stopped: {reason}", 0.0

    def _busy(self, model: ModelProcess) -> ModelBusy:
        busy = ", ".join(sorted(m.name for m in self.models.values() if m.state == ModelState.LOADED and m.in_flight))
        return ModelBusy(f"no room to load model {model.name!r} within {self.config.load_timeout:g} s: the loaded "
                         f"models ({busy or 'none'}) are all answering requests (--models-max "
                         f"{self.config.models_max}, --models-memory); retry")
