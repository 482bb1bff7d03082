"""What one profiled plain step measured, op by op: the scratch each kernel held, and its time.

The static cost model (`costs`) sees only what op types it lists. A profiled step sees every
allocation: TensorFlow's profiler (`tf.profiler.experimental`) records each allocation and
free, with the op that made it where the kernel says, and each kernel's start and duration on
its thread. An allocation no op claims (the buffers of an XLA-compiled function call) belongs
to the op running on that thread at the time: a synchronous kernel's event is named
"op name:op type", an asynchronous one's `ExecutorState::ProcessAsync::Start` carries the op's
name.

From those events, per op: its scratch, the most bytes allocated while it ran and freed before
it ended (what the allocator counts, rounding included); the bytes it allocated that outlived
it; and its kernel time. A gradient op is charged to the forward op it differentiates, read
from its name: `tf.gradients` names it `gradients/<op>_grad/...`, `tf.GradientTape`
`gradient_tape/<op>/...`; the ops of a function that graph optimizers inlined carry the call's
name before their own (Keras's `fit` step), which is dropped. Ops graph optimizers fused carry
the name of one of the fused ops, which gets the whole kernel; the others measure nothing.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Iterable, Mapping

#: Prefixes of the name scopes gradient ops are made in.
_GRADIENT_SCOPE = re.compile(r"^(gradients(_\d+)?|gradient_tape)/")
#: Events of TensorFlow's executor and thread pools that are not kernels.
_NOT_KERNELS = ("Threadpool", "ExecutorState", "Memory", "Eager", "TFE_", "FunctionRun")
_ASYNC_KERNEL = "ExecutorState::ProcessAsync::Start"


@dataclasses.dataclass(frozen=True)
class KernelRecord:
    """What one op's kernels did in the profiled step (summed over its runs).

    Attributes:
      type: the kernel's type as run (after graph optimizers: `_MklMatMul`, `_FusedConv2D`).
      seconds: time its kernels ran.
      scratch_bytes: the most bytes it held for itself at once: allocated while it ran and
        freed before it ended.
      output_bytes: bytes it allocated that outlived it.
    """

    type: str
    seconds: float
    scratch_bytes: int
    output_bytes: int


@dataclasses.dataclass(frozen=True)
class OpMeasurement:
    """What a forward op and the gradient ops charged to it measured.

    Attributes:
      seconds: time of its forward kernel.
      scratch_bytes: its forward kernel's scratch.
      gradient_seconds: time of its gradient's kernels.
      gradient_kernel_scratch: the scratch of each of its gradient's kernels, largest first.
      gradient_kernel_seconds: the time of each of its gradient's kernels, by its name in
        the gradient function (`gradient_uses.GradientStep.name`).
    """

    seconds: float
    scratch_bytes: int
    gradient_seconds: float
    gradient_kernel_scratch: tuple[int, ...]
    gradient_kernel_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def gradient_scratch_bytes(self) -> int:
        """The largest scratch of its gradient's kernels."""
        return self.gradient_kernel_scratch[0] if self.gradient_kernel_scratch else 0

    def gradient_scratch_at_once(self, threads: int) -> int:
        """The most scratch its gradient's kernels hold together on an executor running
        `threads` kernels at once: a convolution's input and filter gradients are ready
        together, and two threads run them side by side."""
        return sum(self.gradient_kernel_scratch[:threads])


@dataclasses.dataclass(frozen=True)
class MeasuredCosts:
    """One plain training step, measured: pass it as `costs=` to `gradients`, `plan` or
    `GradientTape` to plan from it instead of the static estimates.

    Attributes:
      kernels: what each op's kernels did, by op name (`KernelRecord`).
      peak_bytes: the step's activation peak (bytes above what was resident before it).
      step_seconds: the step's wall time, unprofiled.
      kernel_seconds: the time of all its kernels together, profiled.
      device: the device whose allocator `peak_bytes` was read from.
    """

    kernels: Mapping[str, KernelRecord]
    peak_bytes: int
    step_seconds: float
    kernel_seconds: float
    device: str = "CPU:0"

    def for_ops(self, names: Iterable[str]) -> dict[str, OpMeasurement]:
        """What each of the forward ops `names` measured, its gradient ops' records charged
        to it. Ops not profiled (folded, fused into another, pruned) measure nothing."""
        names = set(names)
        forward: dict[str, list[KernelRecord]] = {}
        gradient: dict[str, list[tuple[str, KernelRecord]]] = {}
        for name, record in self.kernels.items():
            owner, within = _owner_of(name, names)
            if owner is None:
                continue
            if within is None:
                forward.setdefault(owner, []).append(record)
            else:
                gradient.setdefault(owner, []).append((within, record))
        measurements = {}
        for name in forward.keys() | gradient.keys():
            ran, differentiated = forward.get(name, []), gradient.get(name, [])
            kernel_seconds: dict[str, float] = {}
            for within, record in differentiated:
                kernel_seconds[within] = kernel_seconds.get(within, 0.0) + record.seconds
            measurements[name] = OpMeasurement(
                seconds=sum(r.seconds for r in ran),
                scratch_bytes=max((r.scratch_bytes for r in ran), default=0),
                gradient_seconds=sum(kernel_seconds.values()),
                gradient_kernel_scratch=tuple(
                    sorted((r.scratch_bytes for _, r in differentiated), reverse=True)
                ),
                gradient_kernel_seconds=kernel_seconds,
            )
        return measurements

    def largest_scratch(self, count: int = 10) -> list[tuple[str, KernelRecord]]:
        """The `count` ops whose kernels held the most scratch: what the static model is
        most likely not to know."""
        ranked = sorted(self.kernels.items(), key=lambda item: -item[1].scratch_bytes)
        return [(name, record) for name, record in ranked[:count] if record.scratch_bytes]

    def report(self, count: int = 10) -> str:
        """The step's measured peak and time, and the kernels with the most scratch."""
        lines = [
            f"Measured plain step: activation peak {self.peak_bytes / 2**20:.1f} MiB, "
            f"{self.step_seconds * 1e3:.1f} ms, {len(self.kernels)} ops profiled"
        ]
        for name, record in self.largest_scratch(count):
            lines.append(
                f"  {record.scratch_bytes / 2**20:8.2f} MiB scratch  {record.type:<24} {name}"
            )
        return "\n".join(lines)


def _owner_of(name: str, forward: set[str]) -> tuple[str | None, str | None]:
    """The op of `forward` that profiled op `name` is, or whose gradient it is, and then
    `name` within that gradient (None for the op itself). A function graph optimizers
    inlined names its ops after the call (`call/dense/MatMul`): the name is matched without
    its callers, longest first."""
    while True:
        if name in forward:
            return name, None
        if (found := _gradient_of(name, forward)) is not None:
            return found
        if "/" not in name:
            return None, None
        name = name.split("/", 1)[1]


def differentiated_op(name: str, forward: set[str]) -> str | None:
    """The op of `forward` whose gradient op `name` is (None if it is none's)."""
    found = _gradient_of(name, forward)
    return None if found is None else found[0]


def _gradient_of(name: str, forward: set[str]) -> tuple[str, str] | None:
    """The op of `forward` whose gradient op `name` is, and its name within that gradient's
    scope (`gradients/<op>_grad/<within>`, `gradient_tape/<op>/<within>`)."""
    scope = _GRADIENT_SCOPE.match(name)
    if scope is None:
        return None
    scoped = name[scope.end() :]
    rest = scoped
    while "/" in rest:
        rest = rest.rsplit("/", 1)[0]
        within = scoped[len(rest) + 1 :]
        if rest.endswith("_grad") and rest[: -len("_grad")] in forward:
            return rest[: -len("_grad")], within
        if rest in forward:
            return rest, within
    return None


@dataclasses.dataclass
class _Run:
    """One run of a kernel on a thread."""

    name: str
    type: str
    start: int
    end: int
    scratch: int = 0
    outlived: int = 0


def kernel_records(space) -> dict[str, KernelRecord]:
    """`KernelRecord`s of every op a profiler's `XSpace` shows running."""
    runs: list[_Run] = []
    allocations: list[tuple[int, dict, _Run | None]] = []  # (time, stats, owner)
    frees: list[tuple[int, int]] = []  # (time, address)
    for plane in space.planes:
        event_names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            kernels: list[_Run] = []
            memory: list[tuple[int, str, dict]] = []
            for event in line.events:
                name = event_names[event.metadata_id]
                start = base + event.offset_ps
                if name in ("MemoryAllocation", "MemoryDeallocation"):
                    memory.append((start, name, _stats(event, stat_names)))
                elif name == _ASYNC_KERNEL:
                    stats = _stats(event, stat_names)
                    if "name" in stats:
                        kind = stats.get("kernel_type", "?")
                        kernels.append(_Run(stats["name"], kind, start, start + event.duration_ps))
                elif ":" in name and "::" not in name and not name.startswith(_NOT_KERNELS):
                    op_name, kind = name.split(":", 1)
                    kernels.append(_Run(op_name, kind, start, start + event.duration_ps))
            runs.extend(kernels)
            kernels.sort(key=lambda run: run.start)
            starts = [run.start for run in kernels]
            by_name: dict[str, list[_Run]] = {}
            for run in kernels:
                by_name.setdefault(run.name, []).append(run)
            for time, kind, stats in memory:
                if kind == "MemoryDeallocation":
                    frees.append((time, stats.get("addr", 0)))
                    continue
                allocations.append((time, stats, _owner(time, stats, kernels, starts, by_name)))
    _charge(allocations, frees)
    records: dict[str, KernelRecord] = {}
    for run in runs:
        seen = records.get(run.name)
        records[run.name] = KernelRecord(
            type=run.type,
            seconds=(seen.seconds if seen else 0.0) + (run.end - run.start) * 1e-12,
            scratch_bytes=max(seen.scratch_bytes if seen else 0, run.scratch),
            output_bytes=(seen.output_bytes if seen else 0) + run.outlived,
        )
    return records


def _stats(event, stat_names: dict) -> dict:
    values = {}
    for stat in event.stats:
        kind = stat.WhichOneof("value")
        value = getattr(stat, kind)
        values[stat_names[stat.metadata_id]] = stat_names[value] if kind == "ref_value" else value
    return values


def _owner(time: int, stats: dict, kernels: list[_Run], starts: list[int], by_name) -> _Run | None:
    """The run an allocation belongs to: of the op it names, running then on this thread, or
    else the innermost run on this thread it falls within."""
    named = stats.get("tf_op")
    if named:
        for run in by_name.get(named, ()):
            if run.start <= time <= run.end:
                return run
    index = bisect.bisect_right(starts, time)
    for run in reversed(kernels[max(index - 8, 0) : index]):
        if run.start <= time <= run.end:
            return run
    return None


def _charge(
    allocations: list[tuple[int, dict, _Run | None]], frees: list[tuple[int, int]]
) -> None:
    """Charge each allocation to its run: as scratch where it is freed before the run ends
    (the run's scratch is the most of it alive at once), as output where it outlives it."""
    freed = _free_times(allocations, frees)
    changes: dict[int, list[tuple[int, int]]] = {}  # id(run) -> (time, bytes allocated)
    runs: dict[int, _Run] = {}
    for order, (time, stats, run) in enumerate(allocations):
        if run is None:
            continue
        size = stats.get("allocation_bytes", 0)
        end = freed.get(order)
        if end is None or end > run.end:
            run.outlived += size
            continue
        changes.setdefault(id(run), []).extend([(time, size), (end, -size)])
        runs[id(run)] = run
    for key, steps in changes.items():
        live = 0
        for _, change in sorted(steps):
            live += change
            runs[key].scratch = max(runs[key].scratch, live)


def _free_times(
    allocations: list[tuple[int, dict, _Run | None]], frees: list[tuple[int, int]]
) -> dict[int, int]:
    """When each allocation (by its index) was freed: the first free of its address after
    it, before the address is handed out again."""
    events = [
        (time, 1, order, stats.get("addr", 0))
        for order, (time, stats, _) in enumerate(allocations)
    ]
    events += [(time, 0, -1, address) for time, address in frees]
    holder: dict[int, int] = {}  # address -> index of the allocation holding it
    freed: dict[int, int] = {}
    for time, is_allocation, order, address in sorted(events):
        if is_allocation:
            holder[address] = order
        elif address in holder:
            freed[holder.pop(address)] = time
    return freed
