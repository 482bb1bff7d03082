"""What is alive at a step's memory peak, from TensorFlow's profiler: tells the executor's
order apart from the allocator's rounding when peaks of the same step differ.

TensorFlow's CPU allocator hands a request a free block of less than twice its size whole,
so the allocator's peak (what `profiling.peak_memory` reads) is the bytes its live blocks
hold. The bytes the live tensors requested are what the cost model predicts; their largest
sum over a step moves only when the executor runs ops in another order. The profiler records
every allocation and free, each with both sizes, and the op that asked.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import tempfile
from collections.abc import Callable
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A live buffer: the op that allocated it, bytes requested and bytes handed out."""

    op: str
    requested: int
    allocated: int


@dataclasses.dataclass(frozen=True)
class Trace:
    """One profiled step.

    Attributes:
      peak: the allocator's peak above resident memory.
      live_at_peak: what was alive at the largest sum of blocks handed out.
      requested_peak: the largest sum of bytes the live tensors requested.
      live_at_requested_peak: what was alive then.
    """

    peak: int
    live_at_peak: dict[int, Allocation]
    requested_peak: int
    live_at_requested_peak: dict[int, Allocation]

    @property
    def requested_at_peak(self) -> int:
        """Bytes requested by what was alive at the allocator's peak: the rest is rounding."""
        return sum(allocation.requested for allocation in self.live_at_peak.values())


def profiled(run: Callable[[], object], device: str = "CPU:0") -> Trace:
    """Run one step under the profiler and replay its allocations.

    The profile is read with TensorFlow's own protocol buffer (`xplane_pb2`): TensorFlow has
    no public reader of its profiles.
    """
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory(prefix="msg_trace_") as logdir:
        tf.config.experimental.reset_memory_stats(device)
        resident = tf.config.experimental.get_memory_info(device)["current"]
        tf.profiler.experimental.start(logdir)
        try:
            run()
        finally:
            tf.profiler.experimental.stop()
        peak = tf.config.experimental.get_memory_info(device)["peak"] - resident
        space = xplane_pb2.XSpace()
        (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        space.ParseFromString(Path(path).read_bytes())
    plane = next(p for p in space.planes if p.name == "/host:CPU")
    names = {key: meta.name for key, meta in plane.event_metadata.items()}
    stats = {key: meta.name for key, meta in plane.stat_metadata.items()}
    events = []  # (time, kind, stats, op)
    for line in plane.lines:
        spans: list[tuple[int, int, str]] = []  # the line's op events, in order of start
        for event in line.events:
            name, start = names[event.metadata_id], line.timestamp_ns * 1000 + event.offset_ps
            if name.startswith("Memory"):
                values = {
                    stats[s.metadata_id]: s.int64_value or s.uint64_value for s in event.stats
                }
                events.append((start, name, values, _enclosing(spans, start)))
            else:
                spans.append((start, start + event.duration_ps, name.split(":")[0]))
    events.sort(key=lambda event: event[0])
    return _replay(peak, events)


def _replay(peak: int, events: list[tuple[int, str, dict[str, int], str]]) -> Trace:
    """The largest sums of allocated and of requested bytes over `events`, in time order,
    and what was alive at each."""
    live: dict[int, Allocation] = {}
    allocated = requested = 0
    top, top_live, requested_top, requested_live = 0, {}, 0, {}
    for _, kind, values, op in events:
        if kind == "MemoryAllocation":
            live[values["addr"]] = Allocation(
                op, values["requested_bytes"], values["allocation_bytes"]
            )
            allocated += values["allocation_bytes"]
            requested += values["requested_bytes"]
        elif values["addr"] in live:
            freed = live.pop(values["addr"])
            allocated -= freed.allocated
            requested -= freed.requested
        if allocated > top:
            top, top_live = allocated, dict(live)
        if requested > requested_top:
            requested_top, requested_live = requested, dict(live)
    return Trace(peak, top_live, requested_top, requested_live)


def _enclosing(spans: list[tuple[int, int, str]], time: int) -> str:
    """The op running at `time` on a line (allocations happen inside the op that asks)."""
    index = bisect.bisect_right(spans, (time, float("inf"), "")) - 1
    while index >= 0:
        start, end, name = spans[index]
        if start <= time <= end and not name.startswith(("Threadpool", "ExecutorState")):
            return name
        index -= 1
    return "?"


def by_op(live: dict[int, Allocation]) -> collections.Counter[str]:
    """Requested bytes alive, by the op that allocated them."""
    sizes: collections.Counter[str] = collections.Counter()
    for allocation in live.values():
        sizes[allocation.op] += allocation.requested
    return sizes
