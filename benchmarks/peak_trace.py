"""What is alive at a step's memory peak, from TensorFlow's profiler: tells the executor's
order apart from the allocator's rounding when peaks of the same step differ.

For one zoo model (_src/models/zoo.py) and configuration, each of --steps profiled steps of the
gradient tf.function of benchmarks/determinism.py reports:

- the allocator's peak above resident memory (what `profiling.peak_memory` reads);
- the bytes the live tensors requested at that moment: the rest is the allocator's rounding
  (TensorFlow's CPU allocator hands out a free block of less than twice a request whole);
- the largest sum of requested bytes over the step: it moves only when the executor runs
  ops in another order.

Then the tensors alive at the requested peak of the step where it is largest, by the op that
allocated them, and, where it differs, what was alive only there and not at the smallest.

    python benchmarks/peak_trace.py inception memory
    python benchmarks/peak_trace.py resnet memory --dtype mixed_float16 --threads 1
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import glob
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # determinism, run from anywhere

import determinism
import keras
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from memory_saving_gradients._src.models import zoo

MiB = determinism.MiB


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A live buffer: the op that allocated it, bytes requested and bytes handed out."""

    op: str
    requested: int
    allocated: int


@dataclasses.dataclass(frozen=True)
class Trace:
    """One profiled step."""

    peak: int
    live_at_peak: dict[int, Allocation]
    requested_peak: int
    live_at_requested_peak: dict[int, Allocation]


def profiled(run) -> Trace:
    """Run one step under the profiler and replay its allocations."""
    logdir = tempfile.mkdtemp()
    tf.config.experimental.reset_memory_stats("CPU:0")
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.profiler.experimental.start(logdir)
    run()
    tf.profiler.experimental.stop()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - resident
    space = xplane_pb2.XSpace()
    space.ParseFromString(
        Path(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0]).read_bytes()
    )
    plane = next(p for p in space.planes if p.name == "/host:CPU")
    names = {key: meta.name for key, meta in plane.event_metadata.items()}
    stats = {key: meta.name for key, meta in plane.stat_metadata.items()}
    events = []  # (time, kind, stats, op)
    for line in plane.lines:
        spans = []  # the line's op events, in order of their start
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


def by_op(live: dict[int, Allocation]) -> collections.Counter:
    """Requested bytes alive, by the op that allocated them."""
    sizes: collections.Counter = collections.Counter()
    for allocation in live.values():
        sizes[allocation.op] += allocation.requested
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=list(zoo.ALL))
    parser.add_argument("config", choices=[c.strip("'") for c in determinism.CONFIGS])
    parser.add_argument(
        "--dtype", choices=["float32", "mixed_float16", "mixed_bfloat16"], default="float32"
    )
    parser.add_argument("--threads", type=int, default=2, help="inter-op threads")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="ops listed at the peak")
    for field in dataclasses.fields(zoo.Scale):
        parser.add_argument(
            f"--{field.name}", type=int, default=getattr(determinism.BENCH, field.name)
        )
    args = parser.parse_args(argv)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    keras.mixed_precision.set_global_policy(args.dtype)
    grow = tf.zeros([determinism.GROWN_MIB * MiB // 4])
    del grow
    scale = determinism.scale_of(args)
    model = zoo.ALL[args.model](scale)
    checkpoints = next(
        c for name, c in determinism.CONFIGS.items() if name.strip("'") == args.config
    )
    run = determinism.gradient_step(model, checkpoints, {})
    run()
    run()
    print(f"{args.model}, {args.config}, {args.dtype}, {args.threads} inter-op threads, {scale}")
    print(
        f"{'step':>5}{'peak MiB':>10}{'live requested':>16}{'rounding':>10}{'requested peak':>16}"
    )
    traces = [profiled(run) for _ in range(args.steps)]
    for i, trace in enumerate(traces):
        live = sum(a.requested for a in trace.live_at_peak.values())
        print(
            f"{i:>5}{trace.peak / MiB:>10.2f}{live / MiB:>16.2f}{(trace.peak - live) / MiB:>10.2f}"
            f"{trace.requested_peak / MiB:>16.2f}"
        )
    high = max(traces, key=lambda t: t.requested_peak)
    low = min(traces, key=lambda t: t.requested_peak)
    print(f"\nalive at the largest requested peak ({high.requested_peak / MiB:.2f} MiB), by op:")
    for op, size in by_op(high.live_at_requested_peak).most_common(args.top):
        print(f"  {size / MiB:8.2f} MiB  {op}")
    if high.requested_peak > low.requested_peak:
        more = by_op(high.live_at_requested_peak)
        less = by_op(low.live_at_requested_peak)
        print(f"\nalive there but not at the smallest ({low.requested_peak / MiB:.2f} MiB):")
        for op, size in (more - less).most_common(args.top):
            print(f"  + {size / MiB:8.2f} MiB  {op}")
        print("alive at the smallest but not there:")
        for op, size in (less - more).most_common(args.top):
            print(f"  - {size / MiB:8.2f} MiB  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
