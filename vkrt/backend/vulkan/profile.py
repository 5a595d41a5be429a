"""Device timing: timestamp queries around every submitted command buffer, and per dispatch.

Every command buffer the batch submits (the open batch, and each recorded step graph)
carries a `QueryTimeline`: a timestamp at its start (top of pipe) and one at its end (after
the final host barrier). After the fence wait the two are read back and the difference is
added to `Counters.gpu_us`. That costs a pool reset and two timestamps per recording plus
one `vkGetQueryPoolResults` per submit, all raw `vulkan.lib` calls with prebuilt buffers:
measured ~50 us per submit on llvmpipe (lavapipe creates a query object per timestamp and
flushes before a bottom-of-pipe write), ~0.1% of a SmolLM2 decode step there.

With profiling on, a timestamp is also written after every dispatch (and buffer copy),
labelled with the shader module's name; the time between consecutive timestamps is
attributed to the later command. A step graph recorded while profiling is on keeps its
per-dispatch timestamps, so replays are profiled with one submit. A graph recorded with
profiling off reports only its total (counted as unattributed).

Caveat: the attribution is exact on devices that run dispatches one after another (CPU
devices do); a GPU may overlap independent dispatches, and then a kernel's share includes
the tail of whatever ran beside it. Profiling also adds a timestamp per dispatch, so the
step itself runs a little slower than unprofiled.
"""

from __future__ import annotations

from typing import Any

# Queries per pool. A timeline chains as many pools as one recording needs; each pool is
# reset inside the command buffer right before its first query, so replays re-reset it.
POOL_QUERIES = 512
UNATTRIBUTED = "(unattributed)"
COPY_LABEL = "(buffer copy)"


class QueryTimeline:
    """Timestamps written into one command buffer, in recording order."""

    def __init__(self, vk: Any, device: Any, valid_bits: int, period_ns: float) -> None:
        self.vk, self.lib, self.ffi, self.device = vk, vk.lib, vk.ffi, device
        self.mask = (1 << min(valid_bits, 64)) - 1  # timestamps wrap at their valid bits
        self.period_ns = period_ns  # nanoseconds per tick (VkPhysicalDeviceLimits.timestampPeriod)
        self.pools: list[Any] = []
        self.labels: list[str] = []  # labels[i] names the span ending at query i + 1
        self.count = 0
        self.profiled = False
        self._results = self.ffi.new(f"uint64_t[{POOL_QUERIES}]")
        self._top = vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT
        self._bottom = vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
        # Read after the submit's fence has signalled, when its queries are available. No
        # WAIT bit on the first try: lavapipe idles the whole device for it (~40 us).
        self._flags = vk.VK_QUERY_RESULT_64_BIT
        self._wait_flags = vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT
        self._not_ready = vk.VK_NOT_READY
        self._pool(0)

    def _pool(self, index: int) -> Any:
        while len(self.pools) <= index:
            vk = self.vk
            self.pools.append(vk.vkCreateQueryPool(self.device, vk.VkQueryPoolCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO, queryType=vk.VK_QUERY_TYPE_TIMESTAMP,
                queryCount=POOL_QUERIES), None))
        return self.pools[index]

    def begin(self, cmd: Any, profiled: bool) -> None:
        """First commands of a recording: reset what it will use, stamp the start."""
        self.labels.clear()
        self.profiled = profiled
        pool = self.pools[0]
        # Unprofiled recordings use queries 0 and 1 only; profiled ones may fill the pool.
        self.lib.vkCmdResetQueryPool(cmd, pool, 0, POOL_QUERIES if profiled else 2)
        self.lib.vkCmdWriteTimestamp(cmd, self._top, pool, 0)
        self.count = 1

    def _write(self, cmd: Any) -> None:
        index, slot = divmod(self.count, POOL_QUERIES)
        pool = self.pools[index] if index < len(self.pools) else self._pool(index)
        if slot == 0:
            self.lib.vkCmdResetQueryPool(cmd, pool, 0, POOL_QUERIES)
        self.lib.vkCmdWriteTimestamp(cmd, self._bottom, pool, slot)
        self.count += 1

    def mark(self, cmd: Any, label: str) -> None:
        """A timestamp after the command just recorded (profiled recordings only)."""
        self._write(cmd)
        self.labels.append(label)

    def end(self, cmd: Any) -> None:
        self._write(cmd)

    def _fetch(self, pool: Any, n: int) -> Any:
        lib, results = self.lib, self._results
        result = lib.vkGetQueryPoolResults(self.device, pool, 0, n, 8 * n, results, 8, self._flags)
        if result == self._not_ready:
            result = lib.vkGetQueryPoolResults(self.device, pool, 0, n, 8 * n, results, 8, self._wait_flags)
        if result != 0:
            raise RuntimeError(f"vkGetQueryPoolResults failed with VkResult {result}")
        return results

    def read(self) -> list[int]:
        """The timestamps of the last execution (call after its fence has signalled)."""
        out: list[int] = []
        remaining = self.count
        for pool in self.pools:
            if remaining <= 0:
                break
            n = min(remaining, POOL_QUERIES)
            out.extend(self._fetch(pool, n)[0:n])
            remaining -= n
        return out

    def span_ns(self) -> int:
        """Start-to-end device time of the last execution (call after its fence)."""
        if self.count == 2:  # unprofiled: one call, two queries
            results = self._fetch(self.pools[0], 2)
            return round(((results[1] - results[0]) & self.mask) * self.period_ns)
        stamps = self.read()
        return round(((stamps[-1] - stamps[0]) & self.mask) * self.period_ns)

    def destroy(self) -> None:
        for pool in self.pools:
            self.vk.vkDestroyQueryPool(self.device, pool, None)
        self.pools.clear()


class _Table:
    """Per-label [calls, ns] plus the device time and submits they came from."""

    def __init__(self) -> None:
        self.kernels: dict[str, list[int]] = {}
        self.gpu_ns = 0
        self.submits = 0
        self.steps = 0

    def merge(self, other: _Table) -> None:
        for label, (calls, ns) in other.kernels.items():
            entry = self.kernels.setdefault(label, [0, 0])
            entry[0] += calls
            entry[1] += ns
        self.gpu_ns += other.gpu_ns
        self.submits += other.submits
        self.steps += other.steps

    def report(self) -> dict[str, Any]:
        """Kernels sorted by total time; share = fraction of the phase's device time.

        Per-step fields are None for work never committed to a step."""
        attributed = sum(ns for label, (_, ns) in self.kernels.items() if label != UNATTRIBUTED)
        steps = self.steps
        rows = sorted(self.kernels.items(), key=lambda item: (-item[1][1], item[0]))
        return {
            "steps": steps,
            "submits": self.submits,
            "gpu_ms": self.gpu_ns / 1e6,
            "gpu_ms_per_step": self.gpu_ns / 1e6 / steps if steps else None,
            "attributed_ms": attributed / 1e6,
            "kernels": {label: {
                "calls": calls,
                "total_ms": ns / 1e6,
                "mean_us": ns / 1e3 / calls if calls else None,
                "share": ns / self.gpu_ns if self.gpu_ns else 0.0,
                "calls_per_step": calls / steps if steps else None,
                "ms_per_step": ns / 1e6 / steps if steps else None,
            } for label, (calls, ns) in rows},
        }


class Profiler:
    """Accumulates per-kernel device time while enabled.

    Work since the last `commit(phase)` is pending; `commit` files it under a phase name
    (the bench files each engine step under "prefill" or "decode"). Uncommitted work is
    reported under "all" when nothing was ever committed, else under "uncommitted".
    """

    def __init__(self) -> None:
        self.enabled = False
        self.pending = _Table()
        self.phases: dict[str, _Table] = {}

    def add(self, timeline: QueryTimeline) -> int:
        """File one executed timeline; returns its start-to-end device time in ns."""
        stamps = timeline.read()
        mask, period = timeline.mask, timeline.period_ns
        gpu_ns = round(((stamps[-1] - stamps[0]) & mask) * period)
        table = self.pending
        table.gpu_ns += gpu_ns
        table.submits += 1
        kernels = table.kernels
        attributed = 0
        for i, label in enumerate(timeline.labels):
            ns = round(((stamps[i + 1] - stamps[i]) & mask) * period)
            attributed += ns
            entry = kernels.get(label)
            if entry is None:
                entry = kernels[label] = [0, 0]
            entry[0] += 1
            entry[1] += ns
        rest = gpu_ns - attributed  # the final barrier, or a graph recorded unprofiled
        if rest > 0:
            entry = kernels.setdefault(UNATTRIBUTED, [0, 0])
            entry[0] += 0 if timeline.labels else 1
            entry[1] += rest
        return gpu_ns

    def commit(self, phase: str) -> None:
        self.pending.steps += 1
        self.phases.setdefault(phase, _Table()).merge(self.pending)
        self.pending = _Table()

    def reset(self) -> None:
        self.pending = _Table()
        self.phases = {}

    def report(self) -> dict[str, Any]:
        phases = {name: table.report() for name, table in self.phases.items()}
        if self.pending.submits:
            phases["uncommitted" if phases else "all"] = self.pending.report()
        return {"enabled": self.enabled, "phases": phases}
