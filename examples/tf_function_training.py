"""A custom TF2 training loop whose gradients are checkpointed.

Inside `tf.function`, call `memory_saving_gradients.gradients` where you would call
`tf.gradients`. The script trains a deep residual MLP for a few steps, then prints the peak
memory of one step with plain and with checkpointed gradients.

    python examples/tf_function_training.py
"""

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

DEPTH, WIDTH, BATCH = 48, 256, 512


def make_model():
    rng = np.random.default_rng(0)
    return [
        tf.Variable((rng.standard_normal((WIDTH, WIDTH)) * 0.05).astype(np.float32))
        for _ in range(DEPTH)
    ]


def make_train_step(weights, optimizer, checkpointed: bool):
    @tf.function
    def train_step(x, y):
        h = x
        for w in weights:
            h = h + tf.nn.relu(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(h - y))
        if checkpointed:
            grads = msg.gradients(loss, weights, checkpoints="memory")
        else:
            grads = tf.gradients(loss, weights)
        optimizer.apply_gradients(zip(grads, weights, strict=True))
        return loss

    return train_step


def main():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((BATCH, WIDTH)).astype(np.float32))
    y = tf.constant(rng.standard_normal((BATCH, WIDTH)).astype(np.float32))
    for checkpointed in (False, True):
        weights = make_model()
        step = make_train_step(weights, tf.keras.optimizers.SGD(0.01), checkpointed)
        losses = [float(step(x, y)) for _ in range(3)]
        peak = peak_memory(lambda step=step: step(x, y)) / 2**20
        name = "checkpointed" if checkpointed else "plain"
        print(f"{name:>12}: losses {np.round(losses, 4)}, peak activation memory {peak:.0f} MiB")


if __name__ == "__main__":
    main()
