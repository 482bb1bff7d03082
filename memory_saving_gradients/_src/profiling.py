"""Measure the peak memory of one step: how a user sees that checkpointing works.

TensorFlow's allocators pool memory, so process RSS says little; the allocator's own peak,
minus what was resident before the step (weights, inputs), is the memory the step needed.
On the CPU those statistics leave out requests under 256 KiB, which are served apart from
the pool they count (tests/test_memory.py): a step of small tensors reads as needing nothing.
In a `tf.compat.v1.Session` each distinct fetch list keeps its own cached constants, so measure
each configuration in a fresh Session.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import measured
from memory_saving_gradients._src.analysis.measured import MeasuredCosts

#: How long the profiler keeps recording after the profiled step returns. An executor thread
#: records an asynchronous kernel's event (a function call's) when the kernel's call returns,
#: which can be after the done callback has finished the step and woken Python: stopping at
#: once loses that kernel, often the step's longest (seen under load on two cores).
_LATE_EVENTS_SECONDS = 0.25


def peak_memory(run_step: Callable[[], object], device: str = "CPU:0", warmup: int = 1) -> int:
    """Bytes `run_step()` needs on `device` at its peak beyond what was already resident.

    `warmup` calls run first, so one-time allocations (constants, kernel caches) are resident
    before the measured call.
    """
    for _ in range(warmup):
        run_step()
    tf.config.experimental.reset_memory_stats(device)
    resident = tf.config.experimental.get_memory_info(device)["current"]
    run_step()
    return tf.config.experimental.get_memory_info(device)["peak"] - resident


def interleaved_step_times(
    steps: Mapping[str, Callable[[], object]], repeats: int = 3
) -> dict[str, list[float]]:
    """Seconds per call of each step, measured in turns (a, b, a, b, ...).

    Machine speed drifts over minutes; taking turns exposes every step to the same drift, so
    ratios between steps stay meaningful when absolute times do not.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, run_step in steps.items():
            start = time.perf_counter()
            run_step()
            times[name].append(time.perf_counter() - start)
    return times


@dataclasses.dataclass(frozen=True)
class TimeRatio:
    """A step's time over a reference step's, from steps taken in turns: the median of each
    turn's ratio, and the quartiles around it (how far the machine moved it)."""

    median: float
    lower_quartile: float
    upper_quartile: float


def step_time_ratios(
    steps: Mapping[str, Callable[[], object]], reference: str, turns: int = 15, warmup: int = 1
) -> dict[str, TimeRatio]:
    """Each step's time over `reference`'s, measured in turns (`interleaved_step_times`):
    `warmup` turns run untimed first, then each of `turns` turns divides a step's time by the
    reference's in that turn. A turn's steps run seconds apart, under the same load, so the
    ratios of one turn share its drift; their median moves less than a ratio of medians does
    where load comes and goes (two steps of one process on a busy machine)."""
    if reference not in steps:
        raise ValueError(f"reference {reference!r} is not one of the steps {sorted(steps)}.")
    if turns < 1:
        raise ValueError(f"turns must be at least 1, got {turns}.")
    times = interleaved_step_times(steps, warmup + turns)
    return turn_ratios({name: taken[warmup:] for name, taken in times.items()}, reference)


def turn_ratios(times: Mapping[str, list[float]], reference: str) -> dict[str, TimeRatio]:
    """`TimeRatio`s of steps timed in turns (`times[name][i]`: turn i's seconds of a step, as
    `interleaved_step_times` gives them, less any warm-up turns) over the `reference` step's:
    one set of turns compared with several references."""
    if reference not in times:
        raise ValueError(f"reference {reference!r} is not one of the steps {sorted(times)}.")
    uneven = sorted(name for name, taken in times.items() if len(taken) != len(times[reference]))
    if uneven or not times[reference]:
        raise ValueError(
            f"every step needs a time for each of the reference's {len(times[reference])} "
            f"turns (at least one); {uneven} have not as many."
        )
    ratios = {}
    for name, taken in times.items():
        each = sorted(t / r for t, r in zip(taken, times[reference], strict=True))
        quartiles = statistics.quantiles(each, n=4) if len(each) > 1 else [each[0]] * 3
        ratios[name] = TimeRatio(statistics.median(each), quartiles[0], quartiles[2])
    return ratios


def measure_costs(
    run_step: Callable[[], object], device: str = "CPU:0", warmup: int = 1, repeats: int = 3
) -> MeasuredCosts:
    """Measure one plain training step, op by op, to plan from (`costs=` of `gradients`,
    `plan`, `GradientTape`): each kernel's scratch and time, and the step's peak and time.

    `run_step()` runs the step with plain gradients (`tf.gradients`, `tf.GradientTape`): a
    `tf.function`, or a Session's `run` of its fetches. It is called `warmup` times (tracing,
    compiling), `repeats` times timed and measured (`peak_memory`), and once under
    TensorFlow's profiler, which costs about a second per thousand ops to read. Without
    repeats, the profiled call gives the peak and the time too (slowed by profiling).
    Plans match the profile to their ops by name, so build the checkpointed step the way the
    measured one was built (the same model, the same names).

    Raises:
      RuntimeError: the profiler is already running (another profile is being taken).
    """
    for _ in range(warmup):
        run_step()
    times, peaks = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        peaks.append(peak_memory(run_step, device, warmup=0))
        times.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory(prefix="msg_profile_") as directory:
        try:
            tf.profiler.experimental.start(directory)
        except tf.errors.AlreadyExistsError as error:
            raise RuntimeError(
                "measure_costs needs TensorFlow's profiler, which is already running: stop "
                "the other profile (tf.profiler.experimental.stop()) and measure again."
            ) from error
        try:
            start = time.perf_counter()
            profiled_peak = peak_memory(run_step, device, warmup=0)
            profiled_time = time.perf_counter() - start
            time.sleep(_LATE_EVENTS_SECONDS)
        finally:
            tf.profiler.experimental.stop()
        kernels = measured.kernel_records(_tf.read_profile(directory))
    return MeasuredCosts(
        kernels=kernels,
        peak_bytes=min(peaks) if peaks else profiled_peak,
        step_seconds=statistics.median(times) if times else profiled_time,
        kernel_seconds=sum(record.seconds for record in kernels.values()),
        device=device,
    )
