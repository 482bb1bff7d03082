"""One worker of a two-worker MultiWorkerMirroredStrategy cluster on localhost.

The worker takes plain and checkpointed gradients of the same Keras model on its own data
shard inside `strategy.run`, sums each over both workers, and measures the peak memory of
each step. TF_CONFIG must be set before the strategy is made, and collective ops wait for
every worker, so tests/test_distribute.py starts both workers at once, each in a fresh
interpreter:

    python -m tests.multi_worker INDEX PORT_0 PORT_1 OUTPUT_DIR

Each saves its gradients to OUTPUT_DIR/worker_INDEX.npz (local_{method}_{i} for its own
shard, reduced_{method}_{i} summed over both) and prints a JSON report on stdout.
"""

import functools
import json
import os
import pathlib
import sys

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

DEPTH, WIDTH, BATCH_PER_WORKER = 12, 256, 4096
MiB = 2**20
#: Seconds a collective op waits for the other worker before it fails instead of hanging.
COLLECTIVE_TIMEOUT = 120


def main(index: int, ports: list[int], output: pathlib.Path) -> None:
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port}" for port in ports]},
            "task": {"type": "worker", "index": index},
        }
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=COLLECTIVE_TIMEOUT
        )
    )
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]
            + [keras.layers.Dense(1)]
        )
    shard = np.random.default_rng(index).standard_normal((BATCH_PER_WORKER, WIDTH))
    x = tf.constant(shard.astype("f4"))

    def summed_over_workers(gradients_fn):
        """A step giving this worker's gradients and their sum over both workers."""

        @tf.function
        def step(x):
            def replica_gradients(x):
                loss = tf.reduce_sum(tf.square(model(x))) / (BATCH_PER_WORKER * len(ports))
                return gradients_fn(loss, model.trainable_variables)

            local = strategy.run(replica_gradients, args=(x,))
            return local, [strategy.reduce("SUM", g, axis=None) for g in local]

        return step

    checkpointed = functools.partial(msg.gradients, checkpoints="memory")
    steps = {
        "plain": summed_over_workers(tf.gradients),
        "checkpointed": summed_over_workers(checkpointed),
    }
    gradients = {}
    for name, step in steps.items():
        local, reduced = step(x)
        gradients |= {f"local_{name}_{i}": g.numpy() for i, g in enumerate(local)}
        gradients |= {f"reduced_{name}_{i}": g.numpy() for i, g in enumerate(reduced)}
    np.savez(output / f"worker_{index}.npz", **gradients)

    # TensorFlow's CPU allocator counts a fresh block it does not split whole, which would
    # inflate the peak of whichever step runs first: one large block freed first avoids it.
    grow = tf.zeros([256 * MiB // 4])
    del grow
    peaks = {name: [] for name in steps}
    for _ in range(2):
        for name, step in steps.items():
            peaks[name].append(peak_memory(lambda step=step: step(x)[1][0].numpy()))
    graph = steps["checkpointed"].get_concrete_function(x).graph
    report = {
        "index": index,
        "variables": len(model.trainable_variables),
        "recomputed_ops": sum("recompute_" in op.name for op in graph.get_operations()),
        "peaks": {name: min(values) for name, values in peaks.items()},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(port) for port in sys.argv[2:4]], pathlib.Path(sys.argv[4]))
