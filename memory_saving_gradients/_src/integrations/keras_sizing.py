"""The largest batch or sequence of a user's own Keras model whose `fit` step fits a memory limit.

`memory-saving-gradients fit` answers "how much bigger can I train?" for the command's models;
this answers it for any model a user can build at a given size, plain and with each
`checkpoints` the user names, by measuring Keras's own training step (`train_on_batch`, as
`fit` runs it) at the sizes `memory_saving_gradients._src.sizing.search` picks.

A size fits when the step's peak above what was resident before it (weights, optimizer state,
the batch) is within the limit: on CPU nothing stops a step from allocating more, and on a GPU
a step that runs out of memory does not fit either.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from memory_saving_gradients._src.integrations.keras import enable
from memory_saving_gradients._src.planning.policies import CheckpointsArg
from memory_saving_gradients._src.profiling import peak_memory
from memory_saving_gradients._src.sizing import Probe, search

logger = logging.getLogger(__name__)

MIB = 2**20

#: What `build(size)` returns: a compiled Keras model, then `train_on_batch`'s positional
#: arguments for one batch at that size (x, and y and sample weights where the model takes
#: them).
Built = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Largest:
    """The largest size that fits for one way of computing gradients.

    Attributes:
      checkpoints: the `checkpoints` argument, None for Keras's own plain step.
      size: the largest size whose step fits; None where not even `lower` does.
      peak_bytes: that step's peak above resident memory.
      step_seconds: that step's median time.
      capped: `size` is the search's upper bound, so more may fit.
      probes: every size measured, in the order taken.
    """

    checkpoints: CheckpointsArg | None
    size: int | None
    peak_bytes: int | None
    step_seconds: float | None
    capped: bool
    probes: tuple[Probe, ...]

    @property
    def name(self) -> str:
        return _name(self.checkpoints)


def largest(
    build: Callable[[int], Built],
    limit_bytes: int,
    checkpoints: Sequence[CheckpointsArg | None] = (None, "speed", "memory"),
    *,
    lower: int = 1,
    upper: int = 2**16,
    first: int | None = None,
    repeats: int = 3,
) -> list[Largest]:
    """The largest size in [`lower`, `upper`] whose training step fits `limit_bytes`, for
    Keras's plain step (None) and for each of `checkpoints`.

        def build(length):
            model = make_model(sequence_length=length)
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            tokens = np.zeros((2, length), "int32")
            return model, tokens, tokens

        for found in msg.keras.largest(build, 512 * 2**20, [None, "speed", "memory"]):
            print(found.name, found.size, found.step_seconds)

    `build(size)` makes a fresh compiled model and one batch at `size`: `(model, x)`,
    `(model, x, y)` or `(model, x, y, sample_weight)`. Each probe builds it, runs
    `train_on_batch` once to trace and warm up, measures the next step's peak on the first
    GPU (CPU where there is none) and times `repeats` more. The search for each entry after
    plain starts from plain's largest size (`first`, else `lower`, for plain).

    Raises:
      ValueError: `limit_bytes` or the bounds are not positive, or `build` returns no model.
    """
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be above 0 (bytes of memory), got {limit_bytes}.")
    if not 1 <= lower <= upper:
        raise ValueError(f"the sizes searched need 1 <= lower <= upper, got {lower}..{upper}.")
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    found: list[Largest] = []
    start = first or lower
    for chosen in checkpoints:
        answer = search(
            _prober(build, chosen, limit_bytes, device, repeats),
            limit_bytes / MIB,
            start,
            lower,
            upper,
            _name(chosen),
        )
        fitting = answer.fitting
        found.append(
            Largest(
                chosen,
                answer.largest,
                None if fitting is None else round((fitting.activation_mib or 0) * MIB),
                None if fitting is None else fitting.step_s,
                answer.capped,
                answer.probes,
            )
        )
        if chosen is None and answer.largest is not None:
            start = answer.largest
    return found


def _prober(
    build: Callable[[int], Built],
    checkpoints: CheckpointsArg | None,
    limit_bytes: int,
    device: str,
    repeats: int,
) -> Callable[[int], Probe]:
    """`probe(size)`: Keras's training step of a model built at `size`, measured."""
    name = _name(checkpoints)

    def probe(size: int) -> Probe:
        keras.backend.clear_session()
        gc.collect()
        model, *batch = _built(build, size)
        if checkpoints is not None:
            enable(model, checkpoints)

        def step() -> object:
            return model.train_on_batch(*batch)

        try:
            peak = peak_memory(step, device)
            seconds = []
            for _ in range(repeats):
                began = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - began)
        except tf.errors.ResourceExhaustedError:
            logger.info("%s: size %d runs out of memory", name, size)
            return Probe(size, fits=False)
        fits = peak <= limit_bytes
        logger.info(
            "%s: size %d: %.1f MiB, %s", name, size, peak / MIB, "fits" if fits else "too much"
        )
        return Probe(size, fits, peak / MIB, statistics.median(seconds) if seconds else None)

    return probe


def _built(build: Callable[[int], Built], size: int) -> Built:
    """`build(size)`, checked to be a model and a batch."""
    built = build(size)
    if not isinstance(built, tuple) or not built or not isinstance(built[0], keras.Model):
        raise ValueError(
            f"build({size}) returned {type(built).__name__}; it must return a compiled "
            "keras.Model and one batch: (model, x), (model, x, y) or (model, x, y, sample_weight)."
        )
    if len(built) < 2:
        raise ValueError(f"build({size}) returned a model and no batch to train it on.")
    return built


def _name(checkpoints: CheckpointsArg | None) -> str:
    return "plain" if checkpoints is None else repr(checkpoints)
