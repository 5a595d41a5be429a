"""Pipeline stages as Ray actors (`--distributed-executor-backend ray`), for stages on several nodes.

One actor per stage, each with a CPU of a placement group whose bundles Ray spreads over the
cluster's nodes (`SPREAD`: on distinct nodes where there are enough, else packed), so P nodes with a
GPU each hold a model none holds alone. An actor runs the same `StageServer` a local stage process
runs: the engine's calls and their answers are the same pickled tuples, Ray carries them. An
actor's calls run in the order they were made, so a stage answers micro-batches in order.

Ray is imported only here (the `ray` extra): the default executor, local processes, needs none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from vkrt.engine.pipeline import StageServer, StageSpec, _Stage
from vkrt.errors import DeviceLostError, VkrtError

log = logging.getLogger("vkrt")


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise VkrtError(f"--distributed-executor-backend ray needs Ray: pip install 'vkrt[ray]' ({exc})") from exc
    return ray


class _StageActor:
    """The actor's class (wrapped by ray.remote at first use): a StageServer."""

    def __init__(self) -> None:
        self.server = StageServer()

    def load(self, spec: StageSpec, index: int) -> tuple[str, Any]:
        return self.server.load(spec, index)

    def call(self, what: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        return self.server.handle(what, args)


class _RayStage(_Stage):
    """A stage in a Ray actor; `send` queues the call's result reference, `receive` takes the oldest."""

    def __init__(self, index: int, spec: StageSpec, actor: Any, group: Any) -> None:
        self.index = index
        self.spec = spec
        self.actor = actor
        self.group = group  # the placement group of all the stages: stage 0's close removes it
        self.pending: list[Any] = []
        self.send("load", spec, index)

    def send(self, what: str, *args: Any) -> None:
        if what == "load":
            self.pending.append(self.actor.load.remote(*args))
        else:
            self.pending.append(self.actor.call.remote(what, args))

    def receive(self) -> Any:
        ray = _ray()
        ref = self.pending.pop(0)
        try:
            status, payload = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise DeviceLostError(f"{self._name()} stopped (its Ray actor died: {exc}); restart the engine") from None
        return self._answer(status, payload)

    def close(self) -> None:
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        try:
            ray.kill(self.actor)
            if self.index == 0:
                remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 (already gone)
            pass


def ray_stages(specs: Sequence[StageSpec], address: str | None = None) -> list[_Stage]:
    """An actor per stage on the Ray cluster at `address` (None: RAY_ADDRESS, else a local
    instance, unless this process is already connected), their loads under way."""
    ray = _ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        joining = address or os.environ.get("RAY_ADDRESS")
        try:
            ray.init(address=address, num_cpus=None if joining else max(os.cpu_count() or 1, len(specs)),
                     logging_level=logging.WARNING)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            raise VkrtError(f"cannot start or join {where}: {exc}") from exc
    group = placement_group([{"CPU": 1}] * len(specs), strategy="SPREAD")
    try:
        ray.get(group.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError:
        raise VkrtError(f"Ray could not place {len(specs)} pipeline stages (one CPU each) within 120 s; "
                        f"the cluster offers {ray.cluster_resources().get('CPU', 0):g} CPUs") from None
    actor_class = ray.remote(num_cpus=1)(_StageActor)
    stages: list[_Stage] = []
    for i, spec in enumerate(specs):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
        # VKRT_DEVICE of the engine's process is not the actor's: --pipeline-devices names it per stage
        stages.append(_RayStage(i, spec, actor_class.options(scheduling_strategy=strategy).remote(), group))
    return stages


def ready(stages: list[_Stage]) -> list[int]:
    """The indices of the stages whose oldest call has finished (blocks until one has)."""
    ray = _ray()
    heads = {s.pending[0]: s.index for s in stages if isinstance(s, _RayStage) and s.pending}
    done, _ = ray.wait(list(heads), num_returns=1)
    return sorted(heads[ref] for ref in done)
