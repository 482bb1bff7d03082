"""One MirroredStrategy training-step check on two logical CPUs, reported as JSON on stdout.

Logical devices can only be configured before TensorFlow's runtime starts, which pytest's
process has long done, so tests/test_distribute.py runs this module in a fresh interpreter:
`python -m tests.mirrored_worker`.
"""

import json

import numpy as np
import tensorflow as tf

DEPTH, WIDTH, GLOBAL_BATCH = 24, 256, 4096
REPLICAS = 2


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )
    import memory_saving_gradients as msg
    from memory_saving_gradients.profiling import peak_memory
    from tests.helpers import original_of, recomputed_copies

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    rng = np.random.default_rng(0)
    with strategy.scope():
        weights = [
            tf.Variable((rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype("f4"))
            for _ in range(DEPTH)
        ]
        biases = [tf.Variable(rng.standard_normal(WIDTH).astype("f4")) for _ in range(DEPTH)]
    variables = [*weights, *biases]
    inputs = tf.constant(rng.standard_normal((GLOBAL_BATCH, WIDTH)).astype("f4"))

    def loss_of(batch: tf.Tensor) -> tf.Tensor:
        h = batch
        for w, b in zip(weights, biases, strict=True):
            h = tf.tanh(h @ w + b)
        return tf.reduce_sum(h * h) / GLOBAL_BATCH

    def distributed_step(tape_class):
        @tf.function
        def step(batch):
            def replica_gradients(replica_batch):
                with tape_class() as tape:
                    loss = loss_of(replica_batch)
                return tape.gradient(loss, variables)

            per_replica = strategy.run(replica_gradients, args=(batch,))
            return [strategy.reduce("SUM", g, axis=None) for g in per_replica]

        return step

    def one_device_step(tape_class):
        @tf.function
        def step(batch):
            with tape_class() as tape:
                loss = loss_of(batch)
            return tape.gradient(loss, variables)

        return step

    dataset = tf.data.Dataset.from_tensor_slices(inputs).batch(GLOBAL_BATCH)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    replica_batch = inputs[: GLOBAL_BATCH // REPLICAS]
    steps = {
        "mirrored_plain": (distributed_step(tf.GradientTape), batch),
        "mirrored_checkpointed": (distributed_step(msg.GradientTape), batch),
        "one_device_plain": (one_device_step(tf.GradientTape), replica_batch),
        "one_device_checkpointed": (one_device_step(msg.GradientTape), replica_batch),
    }

    checkpointed, argument = steps["mirrored_checkpointed"]
    got = checkpointed(argument)
    plain, _ = steps["mirrored_plain"]
    errors = {
        name: [
            float(tf.reduce_max(tf.abs(g - w)) / tf.reduce_max(tf.abs(w)))
            for g, w in zip(got, want, strict=True)
        ]
        for name, want in [
            ("mirrored_plain", plain(argument)),
            ("one_device_plain", one_device_step(tf.GradientTape)(inputs)),
        ]
    }

    graph = checkpointed.get_concrete_function(argument).graph
    placements = []
    for op in recomputed_copies(graph):
        placements.append([op.name, op.device, original_of(op).device])

    peaks = {}
    for name, (step, argument) in steps.items():
        peaks[name] = min(
            peak_memory(lambda step=step, argument=argument: [g.numpy() for g in step(argument)])
            for _ in range(3)
        )
    report = {"relative_errors": errors, "placements": placements, "peaks": peaks}
    print(json.dumps({**report, "keras_fit": keras_fit_under(strategy)}))


def keras_fit_under(strategy: tf.distribute.Strategy) -> dict:
    """Train the same Keras model with plain and enabled `fit` in `strategy`'s scope: the
    largest weight difference, and how many ops each replica's traced step recomputed."""
    import keras

    import memory_saving_gradients as msg

    rng = np.random.default_rng(1)
    # 256 rows a replica: activations outweigh the weight gradients the all-reduce holds.
    x = rng.standard_normal((1024, 16)).astype("f4")
    y = x.sum(axis=1, keepdims=True)
    weights, recomputed = [], []
    for enabled in (False, True):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((16,))]
                + [keras.layers.Dense(32, activation="tanh") for _ in range(8)]
                + [keras.layers.Dense(1)]
            )
            if enabled:
                msg.keras.enable(model)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")  # slots, mirrored
        graphs = []
        step = model.train_step

        def recording_step(batch, step=step, graphs=graphs):
            graphs.append(tf.compat.v1.get_default_graph())
            return step(batch)

        model.train_step = recording_step
        model.fit(x, y, batch_size=512, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
        recomputed = [sum("recompute_" in op.name for op in g.get_operations()) for g in graphs]
    difference = max(float(np.abs(a - b).max()) for a, b in zip(*weights, strict=True))
    return {"max_weight_difference": difference, "recomputed_per_replica": recomputed}


if __name__ == "__main__":
    main()
