"""Keras `model.fit` on a CIFAR ResNet with checkpointed gradients: one line changes.

`memory_saving_gradients.keras.enable(model)` makes `fit` keep only checkpoints of the
forward pass and recompute the rest during the backward pass; compile, fit, callbacks,
evaluate and predict stay as they were. The script trains the ResNet-56 of He et al. (2016)
for CIFAR-10 (three stages of 9 residual blocks, 16/32/64 channels, 32x32x3 images) twice
from the same initial weights, plainly and checkpointed, on synthetic CIFAR-shaped data (ten
noisy colour patterns; no download), and prints each one's losses, the peak memory of one
training step and its test accuracy, then how far the checkpointed gradients of the trained
model are from TensorFlow's. `checkpoints="balanced"` in place of "memory" trades some of the
saving for a faster step.

    python examples/cifar_resnet_fit.py
    python examples/cifar_resnet_fit.py --tiny    # ResNet-20 on a few images, as the tests run it
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

MiB = 2**20
CLASSES = 10


def resnet(blocks_per_stage: int) -> keras.Model:
    """A CIFAR ResNet of 6 * blocks_per_stage + 2 layers (He et al. 2016, section 4.2), with
    1x1 projections where a stage halves the image and doubles the channels."""
    inputs = keras.Input((32, 32, 3))
    h = conv_bn(inputs, 16)
    h = keras.layers.ReLU()(h)
    for stage, channels in enumerate((16, 32, 64)):
        for block in range(blocks_per_stage):
            strides = 2 if stage > 0 and block == 0 else 1
            r = keras.layers.ReLU()(conv_bn(h, channels, strides=strides))
            r = conv_bn(r, channels, gamma_initializer="zeros")  # each block starts as identity
            if strides > 1:
                h = conv_bn(h, channels, kernel_size=1, strides=strides)
            h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def conv_bn(h, channels: int, kernel_size: int = 3, strides: int = 1, **batch_norm):
    h = keras.layers.Conv2D(channels, kernel_size, strides, padding="same", use_bias=False)(h)
    return keras.layers.BatchNormalization(momentum=0.9, **batch_norm)(h)


def synthetic_cifar(samples: int, rng: np.random.Generator):
    """Images of one of ten fixed smooth colour patterns under heavy noise, and their class."""
    grid = np.linspace(0, 2 * np.pi, 32)
    frequencies = np.random.default_rng(0).uniform(0.5, 3, (CLASSES, 3, 2))
    patterns = np.sin(
        frequencies[:, None, None, :, 0] * grid[:, None, None]
        + frequencies[:, None, None, :, 1] * grid[None, :, None]
    )
    labels = rng.integers(0, CLASSES, samples)
    noise = rng.standard_normal((samples, 32, 32, 3))
    return (patterns[labels] + 2 * noise).astype("f4"), labels


def train(checkpoints: str | None, data, blocks_per_stage: int, batch: int, epochs: int):
    """A fresh model trained with `fit` (plainly if `checkpoints` is None), its losses per
    epoch, peak MiB of one more step and test accuracy."""
    (x, y), (x_test, y_test) = data
    keras.utils.set_random_seed(0)
    model = resnet(blocks_per_stage)
    if checkpoints is not None:
        msg.keras.enable(model, checkpoints=checkpoints)  # the one line
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
    step = (tf.constant(x[:batch]), tf.constant(y[:batch]))
    peak = peak_memory(lambda: model.train_on_batch(*step)) / MiB
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    return model, history.history["loss"], peak, accuracy


def largest_gradient_difference(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    """The largest difference between a checkpointed and a plain gradient entry of the
    training loss, relative to the largest plain entry. The checkpointed gradients come from
    `memory_saving_gradients.GradientTape`, the tape `enable`'s `train_step` uses."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def both(x, y):
        gradients = []
        for tape_class in (tf.GradientTape, msg.GradientTape):
            with tape_class() as tape:
                loss = loss_fn(y, model(x, training=True))
            gradients.append(tape.gradient(loss, model.trainable_variables))
        return gradients

    plain, checkpointed = both(tf.constant(x), tf.constant(y))
    return float(
        max(tf.reduce_max(tf.abs(c - p)) for p, c in zip(plain, checkpointed, strict=True))
        / max(tf.reduce_max(tf.abs(p)) for p in plain)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small ResNet, for a quick run")
    args = parser.parse_args()
    blocks_per_stage, samples, batch, epochs = (3, 64, 32, 2) if args.tiny else (9, 512, 32, 3)
    rng = np.random.default_rng(1)
    data = synthetic_cifar(samples, rng), synthetic_cifar(256, rng)
    print(f"ResNet-{6 * blocks_per_stage + 2}, batch {batch}, {samples} training images")
    # TensorFlow's CPU allocator counts a fresh block it does not split whole, which would
    # inflate the peak of whichever step runs first: one large block freed first avoids it.
    grow = tf.zeros([1024 * MiB // 4])
    del grow
    peaks = {}
    for name, checkpoints in [("plain", None), ("checkpointed", "memory")]:
        model, losses, peaks[name], accuracy = train(
            checkpoints, data, blocks_per_stage, batch, epochs
        )
        print(
            f"{name:>12}: losses {np.round(losses, 4)}, test accuracy {accuracy:.2f}, "
            f"peak activation memory {peaks[name]:.0f} MiB"
        )
    print(f"checkpointed training step: {peaks['plain'] / peaks['checkpointed']:.1f}x less memory")
    (x, y), _ = data
    difference = largest_gradient_difference(model, x[:batch], y[:batch])
    print(f"checkpointed gradients differ from tf.gradients by {difference:.1e} at most")


if __name__ == "__main__":
    main()
