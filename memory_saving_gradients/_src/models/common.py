"""What more than one catalogue builds the same way: weights, image and label batches, and a
classifier's loss. Every value comes from a seed, so that a model built twice is the same."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf


def fan_in_normal(
    rng: np.random.RandomState | np.random.Generator,
    shape: Sequence[int],
    name: str | None = None,
) -> tf.Variable:
    """A float32 variable of standard normal values over sqrt(fan-in), the product of all but
    its last dimension: the layer it weighs keeps activations of order one."""
    fan_in = int(np.prod(shape[:-1]))
    value = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype("f4")
    return tf.Variable(value, name=name)


def images(seed: int, batch: int, size: int) -> np.ndarray:
    """A float32 batch of `size` x `size` RGB images of standard normal pixels."""
    return np.random.default_rng(seed).standard_normal((batch, size, size, 3)).astype("f4")


def labels(count: int, classes: int) -> np.ndarray:
    """`count` int32 class ids 0, 1, ..., classes - 1, 0, 1, ...: no draw, and every class in a
    batch of `classes` or more."""
    return (np.arange(count) % classes).astype("i4")


def cross_entropy(targets: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """The mean sparse softmax cross-entropy of logits against class ids, in float32 whatever
    the logits' dtype: a float32 loss under mixed precision too."""
    logits = tf.cast(logits, tf.float32)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
