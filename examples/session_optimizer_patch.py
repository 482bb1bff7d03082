"""TF1-style graph code: patch TensorFlow so that `Optimizer.minimize` checkpoints.

`memory_saving_gradients.patched("memory")` routes `tf.gradients`, `tf.compat.v1.gradients`
and the function `tf.compat.v1.train.Optimizer.minimize` calls to checkpointed gradients for
the duration of the block; `patch()`/`unpatch()` do the same without a block. The script
trains a deep tanh MLP with `MomentumOptimizer` in a Session, plainly and patched, prints the
peak memory of one step each, and how far the patched gradients are from TensorFlow's.

    python examples/session_optimizer_patch.py
"""

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

tf1 = tf.compat.v1
DEPTH, WIDTH, BATCH = 48, 256, 512


def build(patched: bool):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(0)  # the same initial weights in both graphs
        x = tf1.placeholder(tf.float32, [BATCH, WIDTH])
        target = tf1.placeholder(tf.float32, [BATCH, WIDTH])
        h = x
        for i in range(DEPTH):
            w = tf1.get_variable(f"w{i}", [WIDTH, WIDTH], initializer=tf1.orthogonal_initializer())
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(h - target))
        optimizer = tf1.train.MomentumOptimizer(0.5, momentum=0.9)
        if patched:
            with msg.patched("memory"):
                train_op = optimizer.minimize(loss)
        else:
            train_op = optimizer.minimize(loss)
        init = tf1.global_variables_initializer()
    return graph, (x, target), loss, train_op, init


def train(patched: bool):
    """Losses of three steps, then the peak memory of a fourth, in a fresh Session."""
    graph, (x, target), loss, train_op, init = build(patched)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    feed = {x: inputs, target: np.tanh(inputs[:, ::-1])}
    with tf1.Session(graph=graph) as session:
        session.run(init)
        losses = [session.run([train_op, loss], feed)[1] for _ in range(3)]
        return losses, peak_memory(lambda: session.run(train_op, feed))


def largest_gradient_difference() -> float:
    """The largest difference between a patched and a plain `tf.gradients` entry of the loss,
    relative to the largest plain entry, at the initial weights."""
    graph, (x, target), loss, _, init = build(patched=False)
    with graph.as_default():
        variables = tf1.trainable_variables()
        plain = tf.gradients(loss, variables)
        with msg.patched("memory"):
            checkpointed = tf.gradients(loss, variables)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    with tf1.Session(graph=graph) as session:
        session.run(init)
        plain, checkpointed = session.run(
            [plain, checkpointed], {x: inputs, target: np.tanh(inputs[:, ::-1])}
        )
    return float(
        max(np.abs(c - p).max() for p, c in zip(plain, checkpointed, strict=True))
        / max(np.abs(p).max() for p in plain)
    )


def main():
    for patched in (False, True):
        losses, peak = train(patched)
        name = "patched" if patched else "plain"
        mib = peak / 2**20
        print(f"{name:>8}: losses {np.round(losses, 5)}, peak activation memory {mib:.0f} MiB")
    difference = largest_gradient_difference()
    print(f"checkpointed gradients differ from tf.gradients by {difference:.1e} at most")


if __name__ == "__main__":
    main()
