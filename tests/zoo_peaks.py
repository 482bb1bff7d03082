"""Measured peaks of zoo models under each strategy and budget, as JSON on stdout, for
tests/test_zoo_memory.py: `python -m tests.zoo_peaks DTYPE MODEL...`.

A fresh interpreter, because the inter-op thread count must be set before TensorFlow's runtime
starts (one thread, so that a step's peak repeats from step to step), and so that the
allocator starts from one large free block (grown first), from which every request is cut to
size: TensorFlow's CPU allocator hands out a free block of less than twice a request whole,
so a long test process's freed blocks would inflate peaks by what ran before.
"""

from __future__ import annotations

import json
import sys

import keras
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import zoo
from memory_saving_gradients.profiling import peak_memory

MIB = 2**20
GROWN_MIB = 1024
STRATEGIES = {
    "'memory'": "memory",
    "'speed'": "speed",
    "'balanced'": "balanced",
    "MemoryBudget(0.25)": msg.MemoryBudget(0.25),
    "MemoryBudget(0.5)": msg.MemoryBudget(0.5),
}


def step_peak_mib(model: zoo.ZooModel, checkpoints) -> float:
    """The peak of a fresh tf.function computing the model's gradients, above resident."""

    @tf.function
    def step(*inputs):
        loss, _ = model.forward(*inputs)
        # The step returns the gradients: they are held to its end.
        grads = msg.gradients(loss, model.trainable, checkpoints=checkpoints, gradients_held=True)
        return tf.nest.flatten(grads, expand_composites=True)

    return peak_memory(lambda: [t.numpy() for t in step(*model.inputs)]) / MIB


def main(dtype: str, names: list[str]) -> None:
    tf.config.threading.set_inter_op_parallelism_threads(1)  # before anything runs
    keras.mixed_precision.set_global_policy(dtype)
    grow = tf.zeros([GROWN_MIB * MIB // 4])
    del grow
    peaks = {}
    for name in names:
        model = zoo.ALL[name](zoo.SMALL)
        peaks[name] = {label: step_peak_mib(model, c) for label, c in STRATEGIES.items()}
    print(json.dumps(peaks))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
