"""A custom TF2 training loop whose gradients are checkpointed: one line changes.

Inside `tf.function`, use `memory_saving_gradients.GradientTape` where you would use
`tf.GradientTape` (or call `memory_saving_gradients.gradients` where you would call
`tf.gradients`). The script trains a deep residual MLP for a few steps, then prints the peak
memory of one step with plain and with checkpointed gradients, and how far the checkpointed
gradients are from TensorFlow's.

    python examples/tf_function_training.py
"""

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

DEPTH, WIDTH, BATCH = 48, 256, 512


def make_model():
    rng = np.random.default_rng(0)
    scale = 0.2 / np.sqrt(WIDTH)
    return [
        tf.Variable((rng.standard_normal((WIDTH, WIDTH)) * scale).astype(np.float32))
        for _ in range(DEPTH)
    ]


def loss_of(weights, x, y):
    h = x
    for w in weights:
        h = h + tf.nn.relu(tf.matmul(h, w))
    return tf.reduce_mean(tf.square(h - y))


def make_train_step(weights, optimizer, tape_class):
    @tf.function
    def train_step(x, y):
        with tape_class() as tape:
            loss = loss_of(weights, x, y)
        grads = tape.gradient(loss, weights)
        optimizer.apply_gradients(zip(grads, weights, strict=True))
        return loss

    return train_step


def largest_gradient_difference(weights, x, y) -> float:
    """The largest difference between a checkpointed and a plain gradient entry, relative to
    the largest plain entry."""

    @tf.function
    def both():
        gradients = []
        for tape_class in (tf.GradientTape, msg.GradientTape):
            with tape_class() as tape:
                loss = loss_of(weights, x, y)
            gradients.append(tape.gradient(loss, weights))
        return gradients

    plain, checkpointed = both()
    return float(
        max(tf.reduce_max(tf.abs(c - p)) for p, c in zip(plain, checkpointed, strict=True))
        / max(tf.reduce_max(tf.abs(p)) for p in plain)
    )


def main():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((BATCH, WIDTH)).astype(np.float32))
    y = tf.constant(rng.standard_normal((BATCH, WIDTH)).astype(np.float32))
    for name, tape_class in [("plain", tf.GradientTape), ("checkpointed", msg.GradientTape)]:
        weights = make_model()
        step = make_train_step(weights, tf.keras.optimizers.SGD(0.01), tape_class)
        losses = [float(step(x, y)) for _ in range(3)]
        peak = peak_memory(lambda step=step: step(x, y)) / 2**20
        print(f"{name:>12}: losses {np.round(losses, 4)}, peak activation memory {peak:.0f} MiB")
    difference = largest_gradient_difference(weights, x, y)
    print(f"checkpointed gradients differ from tf.gradients by {difference:.1e} at most")


if __name__ == "__main__":
    main()
