"""Measure the peak memory of one step: how a user sees that checkpointing works.

TensorFlow's allocators pool memory, so process RSS says little; the allocator's own peak,
minus what was resident before the step (weights, inputs), is the memory the step needed.
In a `tf.compat.v1.Session` each distinct fetch list keeps its own cached constants, so measure
each configuration in a fresh Session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import tensorflow as tf


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
