"""`MemoryLog`: each epoch's measured step peak, and the saving against plain, in Keras logs.

Checkpointing is worth its recomputation only where it saves memory, so the training log
should say how much: `MemoryLog` adds to each epoch's `logs`, where `History`, `TensorBoard`
and `CSVLogger` read them,

- `peak_memory_mib`: the activation peak of the epoch's median training step, each measured
  as the tests and benchmarks measure it (`profiling.peak_memory`): the allocator's peak
  during the step minus what was resident before it (weights, optimizer state, inputs). The
  median, not the largest: an epoch's first steps also fill the buffers of its input
  pipeline. `step_peaks` holds each step's bytes of the last epoch;
- `plain_peak_memory_mib`, `memory_saved_fraction`: where a plain step was measured
  (`enable(model, ..., measure=True)`, whose first step is plain), that step's activation
  peak, and 1 - measured peak / measured plain peak. That first step is left out of
  `peak_memory_mib`;
- `predicted_peak_mib`, `predicted_plain_peak_mib`, `predicted_memory_saved_fraction`: what
  the plan of the traced training step predicts with its checkpoints and for plain backprop
  (`Plan.step_peak_bytes`: its `peak_bytes`, or `fallback_peak_bytes` where it does not pay
  and gradients are plain; `Plan.plain_peak_bytes`), and the saving between the two. A
  prediction is never set against a measurement: the cost model's plain peak can be far from
  the measured one.

The predictions come from the model's `checkpoint_plan`, which `msg.keras.enable` keeps; a
model that is not enabled logs its peak only.

Limits: the peak is read from TensorFlow's allocator statistics
(`tf.config.experimental.get_memory_info`), which the CPU allocator and the GPU's BFC allocator
keep on TensorFlow 2.21; where a device keeps none, nothing is logged and a warning says so. On
the CPU they leave out small tensors, so a small model's steps can read as allocating nothing:
then nothing is logged either, and a warning says why. They count what that one device
allocates from the start of a batch's callbacks to their end (with `steps_per_execution`,
several steps at once), so an input pipeline running beside the step on the same device counts
too, and copies made on other devices do not. The measured plain step ran under
TensorFlow's profiler as the step's first call.
"""

from __future__ import annotations

import logging
import statistics

import keras
import numpy as np
import tensorflow as tf

from memory_saving_gradients._src.analysis.measured import MeasuredCosts
from memory_saving_gradients._src.planning.plans import MIB, Plan

logger = logging.getLogger(__name__)


class MemoryLog(keras.callbacks.Callback):
    """Adds each epoch's training-step activation peak, and the saving against plain
    backprop's, to `logs` (so History and TensorBoard show them):

        msg.keras.enable(model, "memory", measure=True)  # the first step is plain, measured
        history = model.fit(x, y, epochs=3, callbacks=[msg.keras.MemoryLog()])
        history.history["peak_memory_mib"], history.history["memory_saved_fraction"]

    List it before `TensorBoard` or `CSVLogger`, which write `logs` as they get them.
    `device`: whose allocator to read, e.g. "GPU:0"; by default the first GPU, else the CPU.
    """

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.device = device or ("GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0")
        #: Each training step's activation peak in the latest epoch, in bytes.
        self.step_peaks: list[int] = []
        self._resident = 0
        self._measurable = True
        self._warned_small = False
        self._plain_measured_before = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not hasattr(self.model, "checkpoint_plan"):
            logger.info(
                "MemoryLog: Keras model %s is not enabled by memory_saving_gradients.keras: "
                "only its measured peak is logged, with no saving against plain.",
                self.model.name,
            )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.step_peaks = []

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if not self._measurable:
            return
        self._plain_measured_before = self._plain_peak() is not None
        try:
            tf.config.experimental.reset_memory_stats(self.device)
            self._resident = tf.config.experimental.get_memory_info(self.device)["current"]
        except ValueError as error:
            self._measurable = False
            logger.warning(
                "MemoryLog records no peak: TensorFlow keeps no allocator statistics for %s "
                "(%s).", self.device, error,
            )  # fmt: skip

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self._measurable:
            return
        _wait_for(logs)
        if self._plain_peak() is not None and not self._plain_measured_before:
            return  # the plain step `enable(..., measure=True)` measured itself
        peak = tf.config.experimental.get_memory_info(self.device)["peak"] - self._resident
        self.step_peaks.append(peak)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is None or not self.step_peaks:
            return
        if not any(self.step_peaks):  # a reading of nothing, not a saving of everything
            if not self._warned_small:
                logger.warning(
                    "MemoryLog logs no peak: the allocator statistics of %s show no allocation "
                    "in any step; they leave out small tensors, the only ones these steps make.",
                    self.device,
                )
                self._warned_small = True
            return
        peak = statistics.median_low(self.step_peaks)
        logs["peak_memory_mib"] = peak / MIB
        plain_peak = self._plain_peak()
        if plain_peak:
            logs["plain_peak_memory_mib"] = plain_peak / MIB
            logs["memory_saved_fraction"] = 1 - peak / plain_peak
        plan: Plan | None = getattr(self.model, "checkpoint_plan", None)
        if plan is None:
            return
        plain = plan.plain_peak_bytes
        predicted = plan.step_peak_bytes
        logs["predicted_peak_mib"] = predicted / MIB
        logs["predicted_plain_peak_mib"] = plain / MIB
        logs["predicted_memory_saved_fraction"] = 1 - predicted / plain if plain else 0.0

    def _plain_peak(self) -> int | None:
        """The activation peak of the plain step `enable(..., measure=True)` measured, on this
        callback's device; None where none was."""
        costs: MeasuredCosts | None = getattr(self.model, "measured_costs", None)
        if costs is None or costs.device != self.device:
            return None
        return costs.peak_bytes


def _wait_for(logs: dict | None) -> None:
    """Wait for the step to finish, by reading what it returned: a function call may return
    before its kernels have run (on a GPU)."""
    for value in keras.tree.flatten(logs or {}):
        if isinstance(value, tf.Tensor):
            np.asarray(value)
