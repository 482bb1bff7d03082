"""A zoo of real Keras architectures, written the way users write them, at the sizes of a
`Scale`: toy ones for gradient parity of whole training losses (tests/test_zoo.py), larger ones
for memory tests and suites (tests/test_zoo_memory.py, `bench --suite determinism`).

Each builder creates its variables eagerly and returns a `ZooModel`: `forward(*inputs)`, called
inside a `tf.function`, builds the training-mode forward pass and returns the scalar loss and
some layer outputs ("taps") a test may checkpoint explicitly or add to the collection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from memory_saving_gradients._src.models import common

Forward = Callable[..., tuple[tf.Tensor, list[tf.Tensor]]]

#: Classes of every classifier.
CLASSES = 5


@dataclasses.dataclass(frozen=True)
class Scale:
    """How large the zoo's models and batches are built.

    Attributes:
      size, batch: image side and batch of the image models.
      length, dim: tokens per sequence and model width of the transformer (its batch is
        `batch`).
      rows, width: rows of the MLPs' batches and their width; enough rows that
        activations, not weight gradients, make the peak (where they do not, 'balanced'
        rightly recomputes nothing).
    """

    size: int = 16
    batch: int = 2
    length: int = 8
    dim: int = 16
    rows: int = 128
    width: int = 32


#: Toy sizes, for gradient parity (tests/test_zoo.py).
TOY = Scale()
#: The smallest sizes whose activations TensorFlow's allocator statistics count (it ignores
#: requests under 256 KiB) in float16 as well: for memory tests.
SMALL = Scale(size=96, batch=8, length=256, dim=64, rows=16384, width=32)


@dataclasses.dataclass
class ZooModel:
    """A model's training loss and what it is differentiated against.

    Attributes:
      forward: `forward(*inputs) -> (loss, taps)`, built inside a tf.function.
      inputs: the arguments of `forward` (images or token ids, then labels).
      trainable: the variables the gradients are taken against.
      state: every variable the forward pass reads or updates (batch-norm statistics, dropout
        seed generators): `restore` puts back their initial values, so separate runs see
        the same state.
      one_function: the forward pass draws from unseeded stateful random ops, whose values
        differ between two tf.functions; the reference and the checkpointed gradients must
        then come from one function call.
    """

    forward: Forward
    inputs: tuple[np.ndarray, ...]
    trainable: list
    state: list
    one_function: bool = False
    initial: list[np.ndarray] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.initial = [np.array(v.numpy()) for v in self.state]

    def restore(self) -> None:
        for variable, value in zip(self.state, self.initial, strict=True):
            variable.assign(value)


def _images(seed: int, scale: Scale) -> np.ndarray:
    return common.images(seed, scale.batch, scale.size)


def _labels(*shape: int) -> np.ndarray:
    return common.labels(int(np.prod(shape)), CLASSES).reshape(shape)


def _classifier(model: keras.Model, x: np.ndarray, labels: np.ndarray, **kw) -> ZooModel:
    """A functional model whose outputs are [logits, *taps], trained with cross-entropy."""

    def forward(images, targets):
        logits, *taps = model(images, training=True)
        logits = tf.cast(logits, tf.float32)  # a float32 loss under mixed precision too
        loss = keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)
        return tf.reduce_mean(loss), taps

    return ZooModel(forward, (x, labels), model.trainable_variables, model.variables, **kw)


def _head(h):
    return layers.Dense(CLASSES)(layers.GlobalAveragePooling2D()(h))


# (a) Residual CNN with bottleneck blocks -----------------------------------------------------


class FusedBatchNorm(layers.Layer):
    """Training-mode batch norm as one FusedBatchNormV3 op, as tf.keras 2 ran it (Keras 3's
    BatchNormalization lowers to moments and elementwise ops): with the convolution's bias
    before it and a ReLU after it, the pattern oneDNN's graph rewrites fuse."""

    def build(self, shape):
        # float32 under mixed precision too: the op takes a float32 scale and offset.
        self.gamma = self.add_weight(
            shape=(shape[-1],), initializer="ones", name="gamma", autocast=False
        )
        self.beta = self.add_weight(
            shape=(shape[-1],), initializer="zeros", name="beta", autocast=False
        )

    def call(self, x):
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            x, tf.convert_to_tensor(self.gamma), tf.convert_to_tensor(self.beta), is_training=True
        )
        return y


def _conv_bn(h, filters, kernel, strides=1, relu=True):
    h = layers.Conv2D(filters, kernel, strides, padding="same", use_bias=True)(h)
    h = FusedBatchNorm()(h)
    return layers.ReLU()(h) if relu else h


def _bottleneck(h, filters, strides=1):
    out = 4 * filters
    shortcut = h
    if strides != 1 or h.shape[-1] != out:
        shortcut = _conv_bn(h, out, 1, strides, relu=False)  # projection shortcut
    r = _conv_bn(h, filters, 1)
    r = _conv_bn(r, filters, 3, strides)
    r = _conv_bn(r, out, 1, relu=False)
    return layers.ReLU()(layers.Add()([shortcut, r]))


def resnet(scale: Scale = TOY) -> ZooModel:
    keras.utils.set_random_seed(10)
    inputs = keras.Input((scale.size, scale.size, 3))
    h = _conv_bn(inputs, 8, 3)
    taps = [h]
    for filters, strides in [(4, 1), (4, 1), (8, 2)]:
        h = _bottleneck(h, filters, strides)
        taps.append(h)
    model = keras.Model(inputs, [_head(h), *taps])
    return _classifier(model, _images(0, scale), _labels(scale.batch))


# (b) DenseNet-style dense blocks -----------------------------------------------------------


def _bn_relu_conv(h, filters, kernel):
    h = layers.ReLU()(layers.BatchNormalization()(h))
    return layers.Conv2D(filters, kernel, padding="same", use_bias=False)(h)


def densenet(scale: Scale = TOY, growth: int = 4) -> ZooModel:
    keras.utils.set_random_seed(11)
    inputs = keras.Input((scale.size, scale.size, 3))
    h = layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    taps = []
    for block, count in enumerate([3, 2]):
        for _ in range(count):
            new = _bn_relu_conv(_bn_relu_conv(h, 2 * growth, 1), growth, 3)
            h = layers.Concatenate()([h, new])
            taps.append(h)
        if block == 0:  # transition: compress and halve the resolution
            h = layers.AveragePooling2D(2)(_bn_relu_conv(h, h.shape[-1] // 2, 1))
    h = layers.ReLU()(layers.BatchNormalization()(h))
    model = keras.Model(inputs, [_head(h), *taps])
    return _classifier(model, _images(1, scale), _labels(scale.batch))


# (c) MobileNetV2 inverted residuals ----------------------------------------------------------


def _inverted_residual(h, out, strides, expansion=4):
    r = layers.Conv2D(expansion * h.shape[-1], 1, use_bias=False)(h)
    r = layers.ReLU(6.0)(layers.BatchNormalization()(r))
    r = layers.DepthwiseConv2D(3, strides, padding="same", use_bias=False)(r)
    r = layers.ReLU(6.0)(layers.BatchNormalization()(r))
    r = layers.BatchNormalization()(layers.Conv2D(out, 1, use_bias=False)(r))  # linear
    return layers.Add()([h, r]) if strides == 1 and h.shape[-1] == out else r


def mobilenet_v2(scale: Scale = TOY) -> ZooModel:
    keras.utils.set_random_seed(12)
    inputs = keras.Input((scale.size, scale.size, 3))
    h = layers.Conv2D(8, 3, 2, padding="same", use_bias=False)(inputs)
    h = layers.ReLU(6.0)(layers.BatchNormalization()(h))
    taps = []
    for out, strides in [(8, 1), (8, 1), (12, 2), (12, 1)]:
        h = _inverted_residual(h, out, strides)
        taps.append(h)
    h = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(24, 1, use_bias=False)(h)))
    model = keras.Model(inputs, [_head(h), *taps])
    return _classifier(model, _images(2, scale), _labels(scale.batch))


# (d) Inception-style multi-branch blocks -----------------------------------------------------


def _conv_relu(h, filters, kernel):
    return layers.Conv2D(filters, kernel, padding="same", activation="relu")(h)


def _inception(h, width):
    one = _conv_relu(h, width, 1)
    three = _conv_relu(_conv_relu(h, width, 1), width, 3)
    five = _conv_relu(_conv_relu(h, width // 2, 1), width, 5)
    pool = _conv_relu(layers.MaxPooling2D(3, 1, padding="same")(h), width, 1)
    return layers.Concatenate()([one, three, five, pool])


def inception(scale: Scale = TOY) -> ZooModel:
    keras.utils.set_random_seed(13)
    inputs = keras.Input((scale.size, scale.size, 3))
    h = _conv_relu(inputs, 8, 3)
    first = _inception(h, 4)
    h = layers.MaxPooling2D(2)(first)
    second = _inception(h, 6)
    model = keras.Model(inputs, [_head(second), first, second])
    return _classifier(model, _images(3, scale), _labels(scale.batch))


# (e) U-Net encoder-decoder -----------------------------------------------------------------


def _double_conv(h, filters):
    for _ in range(2):
        h = layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = layers.ReLU()(layers.BatchNormalization()(h))
    return h


def unet(scale: Scale = TOY) -> ZooModel:
    """Two levels down, one up with Conv2DTranspose and one with UpSampling2D; a per-pixel
    loss over the classes."""
    keras.utils.set_random_seed(14)
    inputs = keras.Input((scale.size, scale.size, 3))
    skip1 = _double_conv(inputs, 4)
    skip2 = _double_conv(layers.MaxPooling2D(2)(skip1), 8)
    bottom = _double_conv(layers.MaxPooling2D(2)(skip2), 16)
    up2 = layers.Conv2DTranspose(8, 2, strides=2)(bottom)
    dec2 = _double_conv(layers.Concatenate()([skip2, up2]), 8)
    up1 = layers.Conv2D(4, 1)(layers.UpSampling2D(2)(dec2))
    dec1 = _double_conv(layers.Concatenate()([skip1, up1]), 4)
    logits = layers.Conv2D(CLASSES, 1)(dec1)
    model = keras.Model(inputs, [logits, skip1, skip2, bottom, dec2])
    return _classifier(model, _images(4, scale), _labels(scale.batch, scale.size, scale.size))


# (f) Transformer encoder with dropout --------------------------------------------------------


class AddPositions(layers.Layer):
    """Learned position embeddings, added to the token embeddings."""

    def build(self, shape):
        self.table = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal")

    def call(self, x):
        return x + self.table


def transformer(scale: Scale = TOY, blocks: int = 2, vocab: int = 40) -> ZooModel:
    """Pre-norm encoder blocks with Keras dropout active (training=True). Keras draws masks
    with stateless random ops from a seed generator's state variable, which the step reads
    and advances: `state` holds it, so separate runs draw the same masks."""
    keras.utils.set_random_seed(15)
    length, dim = scale.length, scale.dim
    tokens = keras.Input((length,), dtype="int32")
    h = AddPositions()(layers.Embedding(vocab, dim)(tokens))
    taps = []
    for _ in range(blocks):
        a = layers.LayerNormalization()(h)
        a = layers.MultiHeadAttention(num_heads=2, key_dim=dim // 2, dropout=0.1)(a, a)
        h = h + layers.Dropout(0.1)(a)
        m = layers.Dense(2 * dim, activation="gelu")(layers.LayerNormalization()(h))
        h = h + layers.Dropout(0.1)(layers.Dense(dim)(m))
        taps.append(h)
    pooled = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(h))
    model = keras.Model(tokens, [layers.Dense(CLASSES)(pooled), *taps])
    ids = np.random.default_rng(5).integers(0, vocab, (scale.batch, length)).astype("i4")
    return _classifier(model, ids, _labels(scale.batch))


# (g) MLP: matmul + bias + relu, with unseeded dropout ----------------------------------------


def unseeded_dropout(x: tf.Tensor, rate: float) -> tf.Tensor:
    """Inverted dropout from a RandomUniform op with seed = seed2 = 0: a stateful op with a
    fresh random stream per kernel, whatever the global seed (`tf.nn.dropout` takes its op
    seed from the global seed that Keras's `set_random_seed` sets, and then every function,
    and every copy of the op, draws the same mask). A recomputed copy would draw another."""
    noise = tf.raw_ops.RandomUniform(shape=tf.shape(x), dtype=x.dtype, seed=0, seed2=0)
    return tf.where(noise >= rate, x / (1.0 - rate), tf.zeros_like(x))


class MLP(keras.Model):
    """Dense layers (MatMul, BiasAdd, Relu: a oneDNN fusion) with unseeded dropout between
    them."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.hidden = [layers.Dense(width, activation="relu") for _ in range(depth)]
        self.out = layers.Dense(CLASSES)
        self.taps: list[tf.Tensor] = []

    def call(self, x, training=False):
        self.taps = []
        for layer in self.hidden:
            x = layer(x)
            if training:
                x = unseeded_dropout(x, 0.25)
            self.taps.append(x)
        return self.out(x)


def mlp(scale: Scale = TOY) -> ZooModel:
    keras.utils.set_random_seed(16)
    model = MLP(scale.width)
    x = np.random.default_rng(6).standard_normal((scale.rows, 12)).astype("f4")
    model(x)

    def forward(inputs, targets):
        logits = tf.cast(model(inputs, training=True), tf.float32)
        loss = keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)
        return tf.reduce_mean(loss), list(model.taps)

    labels = _labels(scale.rows)
    return ZooModel(forward, (x, labels), model.trainable_variables, model.variables, True)


# (h) Layers as nested tf.functions (a call op per layer) -------------------------------------


def function_layers(scale: Scale = TOY, depth: int = 6) -> ZooModel:
    """A residual MLP whose layers are `tf.function`s: the outer graph holds a call op per
    layer call. `dense_relu`, `block` (which calls `dense_relu` twice) and `rms_norm` are
    stateless, their weights passed in as tensors; `project` reads the variable it is given
    inside the function, so its call ops are stateful (kept, never recomputed). Each function
    is called several times. It computes in the Keras policy's compute dtype, as a user
    would under mixed precision: float32 variables cast where read, a float32 loss."""
    rng = np.random.default_rng(7)
    width = scale.width
    compute = keras.mixed_precision.global_policy().compute_dtype

    def read(variable):  # a tensor: a variable passed to a tf.function is read inside it
        return tf.cast(tf.convert_to_tensor(variable), compute)

    def variable(*shape, scale=1.0):
        return tf.Variable((rng.standard_normal(shape) * scale).astype("f4"))

    w_in = variable(12, width, scale=0.3)
    w1s = [variable(width, width, scale=0.25) for _ in range(depth)]
    w2s = [variable(width, width, scale=0.25) for _ in range(depth)]
    bs = [variable(width, scale=0.1) for _ in range(depth)]
    gammas = [tf.Variable(np.ones(width, "f4")) for _ in range(depth)]
    w_out = variable(width, CLASSES, scale=0.3)

    @tf.function
    def dense_relu(h, w, b):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(h, w), b))

    @tf.function
    def block(h, w1, w2, b):
        return h + 0.5 * dense_relu(dense_relu(h, w1, b), w2, b)

    @tf.function
    def rms_norm(h, gamma):
        return h * gamma * tf.math.rsqrt(tf.reduce_mean(tf.square(h), -1, keepdims=True) + 1e-3)

    @tf.function
    def project(h, w):
        return tf.matmul(h, read(w))

    def forward(x, targets):
        h = project(tf.cast(x, compute), w_in)
        taps = []
        for w1, w2, b, gamma in zip(w1s, w2s, bs, gammas, strict=True):
            h = rms_norm(block(h, read(w1), read(w2), read(b)), read(gamma))
            taps.append(h)
        return common.cross_entropy(targets, project(h, w_out)), taps

    variables = [w_in, *w1s, *w2s, *bs, *gammas, w_out]
    x = rng.standard_normal((scale.rows, 12)).astype("f4")
    return ZooModel(forward, (x, _labels(scale.rows)), variables, variables)


# (i) tf.custom_gradient inside a Keras layer ---------------------------------------------------


@tf.custom_gradient
def _swish(x):
    s = tf.sigmoid(x)
    y = x * s

    def grad(dy):
        return dy * (s + y * (1.0 - s))

    return y, grad


class Swish(layers.Layer):
    """swish(x) = x * sigmoid(x) with a hand-written gradient (`tf.custom_gradient`)."""

    def call(self, x):
        return _swish(x)


def custom_gradient_cnn(scale: Scale = TOY) -> ZooModel:
    keras.utils.set_random_seed(17)
    inputs = keras.Input((scale.size, scale.size, 3))
    h, taps = inputs, []
    for filters in [8, 8, 12]:
        r = layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        r = Swish()(layers.BatchNormalization()(r))
        h = layers.Add()([h, r]) if h.shape[-1] == filters else r
        taps.append(h)
    model = keras.Model(inputs, [_head(h), *taps])
    return _classifier(model, _images(8, scale), _labels(scale.batch))


ALL: dict[str, Callable[..., ZooModel]] = {
    "resnet": resnet,
    "densenet": densenet,
    "mobilenet_v2": mobilenet_v2,
    "inception": inception,
    "unet": unet,
    "transformer": transformer,
    "mlp": mlp,
    "function_layers": function_layers,
    "custom_gradient_cnn": custom_gradient_cnn,
}
