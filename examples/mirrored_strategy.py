"""A tf.distribute custom training loop with checkpointed gradients on each replica.

Inside `strategy.run`, `memory_saving_gradients.GradientTape` replaces `tf.GradientTape`;
every replica recomputes its own segments on its own device. The script splits the CPU into
two logical devices, trains a deep MLP under `MirroredStrategy`, then prints the peak memory
of one step (both replicas) with plain and with checkpointed gradients, and how far the
checkpointed gradients are from TensorFlow's. The same step runs unchanged under
`tf.distribute.MultiWorkerMirroredStrategy`.

    python examples/mirrored_strategy.py
"""

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

DEPTH, WIDTH, GLOBAL_BATCH, REPLICAS = 32, 256, 2048, 2


def make_model(strategy):
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.Input((WIDTH,))]
            + [tf.keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]
            + [tf.keras.layers.Dense(1)]
        )
        optimizer = tf.keras.optimizers.SGD(0.05)
    return model, optimizer


def replica_loss(model, x, y, global_batch: int):
    """This replica's share of the mean squared error over the global batch."""
    per_example = tf.square(model(x, training=True)[:, 0] - y)
    return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)


def make_train_step(strategy, model, optimizer, tape_class):
    def replica_step(x, y):
        with tape_class() as tape:
            loss = replica_loss(model, x, y, GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(x, y):
        losses = strategy.run(replica_step, args=(x, y))
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


def main():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH, WIDTH)).astype(np.float32)
    y = np.sin(x.sum(axis=1)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
    batches = iter(strategy.experimental_distribute_dataset(dataset))
    for name, tape_class in [("plain", tf.GradientTape), ("checkpointed", msg.GradientTape)]:
        tf.keras.utils.set_random_seed(0)
        model, optimizer = make_model(strategy)
        step = make_train_step(strategy, model, optimizer, tape_class)
        losses = [float(step(*next(batches))) for _ in range(3)]
        batch = next(batches)
        peak = peak_memory(lambda step=step, batch=batch: float(step(*batch))) / 2**20
        print(f"{name:>12}: losses {np.round(losses, 4)}, peak activation memory {peak:.0f} MiB")
    difference = make_gradient_difference(strategy, model, GLOBAL_BATCH)(next(batches))
    print(f"checkpointed gradients differ from tf.gradients by {difference:.1e} at most")


if __name__ == "__main__":
    main()
