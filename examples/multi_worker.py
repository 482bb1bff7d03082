"""Data-parallel training on a cluster of workers, each checkpointing its own gradients.

Every worker of a `tf.distribute.MultiWorkerMirroredStrategy` cluster runs this same script,
told the cluster and its own place in it by the TF_CONFIG environment variable, which must be
set before the strategy is made. On two machines, for example:

    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                "task": {"type": "worker", "index": 0}}' python examples/multi_worker.py
    # and the same on host1 with "index": 1

Without TF_CONFIG the script makes such a cluster itself: two workers on localhost, each a
fresh Python process, and prints what each reports. Inside `strategy.run` each worker takes
the gradients of its own shard of the data with `memory_saving_gradients.GradientTape`; the
optimizer sums them over the workers as it always does. Each worker trains a deep MLP with
plain and with checkpointed gradients, prints the peak memory of one step of each, and how far
the checkpointed gradients are from TensorFlow's.

    python examples/multi_worker.py
    python examples/multi_worker.py --tiny    # a small model, as the tests run it
"""

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

MiB = 2**20
#: Seconds a collective op waits for the other workers: a worker whose peer died fails
#: instead of waiting forever.
COLLECTIVE_TIMEOUT = 300


def make_model(strategy: tf.distribute.Strategy, depth: int, width: int):
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
            + [keras.layers.Dense(1)]
        )
        optimizer = keras.optimizers.SGD(0.05)
    return model, optimizer


def replica_loss(model, x, y, global_batch: int):
    """This replica's share of the mean squared error over the global batch."""
    per_example = tf.square(model(x, training=True)[:, 0] - y)
    return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)


def make_train_step(strategy, model, optimizer, tape_class, global_batch: int):
    """A training step: each worker takes the gradients of its batch with `tape_class`, and
    `apply_gradients` sums them over the workers before it updates the weights."""

    def replica_step(x, y):
        with tape_class() as tape:
            loss = replica_loss(model, x, y, global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(batch):
        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce("SUM", losses, axis=None)

    return train_step


def make_gradient_difference(strategy, model, global_batch: int):
    """A step giving the largest difference between a checkpointed and a plain gradient
    entry of a replica's loss, relative to the largest plain entry, over this worker's
    replicas."""

    def replica_difference(x, y):
        gradients = []
        for tape_class in (tf.GradientTape, msg.GradientTape):
            with tape_class() as tape:
                loss = replica_loss(model, x, y, global_batch)
            gradients.append(tape.gradient(loss, model.trainable_variables))
        plain, checkpointed = gradients
        largest = tf.reduce_max([tf.reduce_max(tf.abs(p)) for p in plain])
        pairs = zip(plain, checkpointed, strict=True)
        differences = [tf.reduce_max(tf.abs(c - p)) for p, c in pairs]
        return tf.reduce_max(differences) / largest

    @tf.function
    def difference(batch):
        return strategy.experimental_local_results(strategy.run(replica_difference, args=batch))

    return lambda batch: max(float(d) for d in difference(batch))


def sizes(tiny: bool) -> tuple[int, int, int]:
    """Depth, width and global batch of the model and its training data."""
    return (16, 128, 4096) if tiny else (24, 256, 8192)


def train_as_worker(tiny: bool) -> None:
    """Train as the worker TF_CONFIG names; print the losses and peak memory per method."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=COLLECTIVE_TIMEOUT
        )
    )
    depth, width, global_batch = sizes(tiny)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((global_batch, width)).astype(np.float32)
    y = np.sin(x.sum(axis=1)).astype(np.float32)

    def this_workers_shard(context: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        dataset = dataset.shard(context.num_input_pipelines, context.input_pipeline_id)
        return dataset.batch(context.get_per_replica_batch_size(global_batch)).repeat()

    batches = iter(strategy.distribute_datasets_from_function(this_workers_shard))
    # TensorFlow's CPU allocator counts a fresh block it does not split whole, which would
    # inflate the peak of whichever step runs first: one large block freed first avoids it.
    grow = tf.zeros([512 * MiB // 4])
    del grow
    worker = strategy.cluster_resolver.task_id
    for name, tape_class in [("plain", tf.GradientTape), ("checkpointed", msg.GradientTape)]:
        keras.utils.set_random_seed(0)
        model, optimizer = make_model(strategy, depth, width)
        step = make_train_step(strategy, model, optimizer, tape_class, global_batch)
        losses = [float(step(next(batches))) for _ in range(3)]
        batch = next(batches)
        peak = peak_memory(lambda step=step, batch=batch: float(step(batch))) / MiB
        print(
            f"worker {worker} {name:>12}: losses {np.round(losses, 4)}, "
            f"peak activation memory {peak:.0f} MiB",
            flush=True,
        )
    difference = make_gradient_difference(strategy, model, global_batch)(next(batches))
    print(
        f"worker {worker} checkpointed gradients differ from tf.gradients by "
        f"{difference:.1e} at most",
        flush=True,
    )


def local_cluster(workers: int) -> list[str]:
    """The TF_CONFIG of each worker of a cluster on localhost, at ports free now."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(workers)]
        for probe in probes:
            probe.bind(("localhost", 0))  # the system picks a free port, freed for the worker
        addresses = [f"localhost:{probe.getsockname()[1]}" for probe in probes]
    return [
        json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})
        for i in range(workers)
    ]


def launch_local_cluster(arguments: list[str], workers: int = 2) -> int:
    """Run this script as every worker of a cluster on localhost, all at once (collective ops
    wait for every worker), and print what each printed, and TensorFlow's log of a worker
    that failed. The exit status: 0 if every worker succeeded."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(workers)]
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, *arguments],
                env={**os.environ, "TF_CONFIG": tf_config},
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            for tf_config, log in zip(local_cluster(workers), logs, strict=True)
        ]
        for process in processes:
            print(process.communicate()[0], end="")
        for process, log in zip(processes, logs, strict=True):
            if process.returncode != 0:
                log.seek(0)
                print(log.read(), file=sys.stderr)
    return 0 if all(process.returncode == 0 for process in processes) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small model, for a quick run")
    args = parser.parse_args()
    if "TF_CONFIG" in os.environ:
        train_as_worker(args.tiny)
        return 0
    return launch_local_cluster(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
