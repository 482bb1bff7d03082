"""A PixelCNN trained with `memory_saving_gradients.gradients` in place of `tf.gradients`.

A PixelCNN (van den Oord et al. 2016) predicts each pixel from those above it and to its left:
masked convolutions hide the rest, and gated residual blocks (tanh(a) * sigmoid(b), where a
and b are two halves of a masked convolution) carry the image through the depth of the
network at full resolution, which makes its activations large. The script trains one on
synthetic binary images of rectangles for a few steps with each gradient function, checks
once that the checkpointed gradients equal `tf.gradients`, and prints the losses and the peak
memory of one training step.

    python examples/pixelcnn.py
    python examples/pixelcnn.py --tiny    # smaller images and network, as the tests run it
"""

import argparse
import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

MiB = 2**20


class MaskedConv2D(keras.layers.Conv2D):
    """A convolution whose output pixel sees only the input pixels above it and to its left
    (mask "A", for the first layer, which must not see the pixel it predicts) and itself too
    (mask "B", for the layers after it)."""

    def __init__(self, mask_type: str, filters: int, kernel_size: int, **kwargs):
        super().__init__(filters, kernel_size, padding="same", **kwargs)
        self.mask_type = mask_type

    def build(self, input_shape):
        super().build(input_shape)
        center = self.kernel_size[0] // 2
        self.mask = np.ones(self.kernel.shape, "f4")
        self.mask[center, center + (self.mask_type == "B") :] = 0
        self.mask[center + 1 :] = 0

    def convolution_op(self, inputs, kernel):
        return super().convolution_op(inputs, kernel * self.mask)


class GatedResidualBlock(keras.layers.Layer):
    """h + a 1x1 convolution of tanh(a) * sigmoid(b), a and b the halves of a masked 3x3
    convolution of h."""

    def __init__(self, channels: int, **kwargs):
        super().__init__(**kwargs)
        self.gates = MaskedConv2D("B", 2 * channels, 3)
        self.mix = keras.layers.Conv2D(channels, 1)

    def call(self, h):
        a, b = tf.split(self.gates(h), 2, axis=-1)
        return h + self.mix(tf.tanh(a) * tf.sigmoid(b))


def pixelcnn(size: int, channels: int, blocks: int) -> keras.Model:
    """Logits of each pixel of a binary image being 1, given the pixels before it."""
    images = keras.Input((size, size, 1))
    h = MaskedConv2D("A", channels, 7)(images)
    for _ in range(blocks):
        h = GatedResidualBlock(channels)(h)
    h = keras.layers.Conv2D(channels, 1, activation="relu")(keras.layers.ReLU()(h))
    return keras.Model(images, keras.layers.Conv2D(1, 1)(h))


def rectangles(batch: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Binary images of one to three filled axis-aligned rectangles each."""
    images = np.zeros((batch, size, size, 1), "f4")
    for image in images:
        for _ in range(rng.integers(1, 4)):
            top, left = rng.integers(0, size - 2, 2)
            bottom, right = rng.integers([top + 2, left + 2], size + 1)
            image[top:bottom, left:right] = 1
    return images


def negative_log_likelihood(model: keras.Model, images: tf.Tensor) -> tf.Tensor:
    """Nats per pixel."""
    logits = model(images)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=images, logits=logits))


def make_train_step(model, optimizer, gradients_fn):
    @tf.function
    def train_step(images):
        loss = negative_log_likelihood(model, images)
        grads = gradients_fn(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return train_step


def largest_gradient_difference(model: keras.Model, images: np.ndarray) -> float:
    """The largest difference between a checkpointed and a `tf.gradients` gradient, relative
    to the largest `tf.gradients` entry of that variable."""

    @tf.function
    def both(images):
        loss = negative_log_likelihood(model, images)
        variables = model.trainable_variables
        return tf.gradients(loss, variables), msg.gradients(loss, variables, checkpoints="memory")

    plain, checkpointed = both(images)
    return max(
        float(tf.reduce_max(tf.abs(c - p)) / tf.reduce_max(tf.abs(p)))
        for p, c in zip(plain, checkpointed, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a smaller network, for a quick run")
    tiny = parser.parse_args().tiny
    size, channels, blocks, batch, steps = (16, 32, 6, 16, 4) if tiny else (28, 32, 12, 16, 12)
    print(f"PixelCNN of {blocks} gated residual blocks, {channels} channels, {size}x{size} images")
    # TensorFlow's CPU allocator counts a fresh block it does not split whole, which would
    # inflate the peak of whichever step runs first: one large block freed first avoids it.
    grow = tf.zeros([1024 * MiB // 4])
    del grow
    peaks = {}
    checkpointed = functools.partial(msg.gradients, checkpoints="memory")
    for name, gradients_fn in [("plain", tf.gradients), ("checkpointed", checkpointed)]:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        model = pixelcnn(size, channels, blocks)
        step = make_train_step(model, keras.optimizers.Adam(1e-3), gradients_fn)
        losses = [float(step(rectangles(batch, size, rng))) for _ in range(steps)]
        images = tf.constant(rectangles(batch, size, rng))
        peaks[name] = peak_memory(lambda step=step, images=images: float(step(images))) / MiB
        print(
            f"{name:>12}: losses {np.round(losses, 3)}, "
            f"peak activation memory {peaks[name]:.0f} MiB"
        )
    difference = largest_gradient_difference(model, rectangles(batch, size, rng))
    print(f"checkpointed gradients differ from tf.gradients by {difference:.1e} at most")
    print(f"checkpointed training step: {peaks['plain'] / peaks['checkpointed']:.1f}x less memory")


if __name__ == "__main__":
    main()
