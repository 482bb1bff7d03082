"""A MultiWorkerMirroredStrategy step on a one-worker cluster, reported as JSON on stdout.

TF_CONFIG must be set before the strategy is made and the collective runtime starts, so
tests/test_distribute.py runs this module in a fresh interpreter:
`python -m tests.multi_worker PORT`.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

DEPTH, WIDTH, BATCH = 12, 64, 256


def main(port: int) -> None:
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"localhost:{port}"]}, "task": {"type": "worker", "index": 0}}
    )
    import memory_saving_gradients as msg

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.Input((WIDTH,))]
            + [tf.keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]
            + [tf.keras.layers.Dense(1)]
        )
    inputs = np.random.default_rng(0).standard_normal((BATCH, WIDTH)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices(inputs).batch(BATCH)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def gradients_step(tape_class):
        @tf.function
        def step(batch):
            def replica_gradients(replica_batch):
                with tape_class() as tape:
                    loss = tf.reduce_mean(tf.square(model(replica_batch)))
                return tape.gradient(loss, model.trainable_variables)

            per_replica = strategy.run(replica_gradients, args=(batch,))
            return [strategy.reduce("SUM", g, axis=None) for g in per_replica]

        return step

    checkpointed = gradients_step(msg.GradientTape)
    errors = [
        float(tf.reduce_max(tf.abs(got - want)) / tf.reduce_max(tf.abs(want)))
        for got, want in zip(
            checkpointed(batch), gradients_step(tf.GradientTape)(batch), strict=True
        )
    ]
    graph = checkpointed.get_concrete_function(batch).graph
    recomputed = sum("recompute_" in op.name for op in graph.get_operations())
    print(json.dumps({"relative_errors": errors, "recomputed_ops": recomputed}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
