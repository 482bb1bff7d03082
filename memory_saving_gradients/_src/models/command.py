"""The models the command measures, at sizes two CPU cores step through in under a second.

A builder makes a model's variables where it is called (eagerly, or in a `tf.compat.v1`
graph) and returns a `Model` whose `loss(wrap)` builds the training forward pass wherever it
is called (a `tf.function`, a graph). Models made of blocks pass every block through `wrap`,
so that a baseline can wrap it in `tf.recompute_grad` or mark its ops for grappler. Chains of
blocks are wrapped in groups of about sqrt(depth) blocks: with equal segments, the length
that keeps the least memory.

Keras layers make their variables on their first call, which must not happen while a
`tf.function` is traced: builders of Keras models run the forward pass once where they are
called, on a batch of one, and take the variables it reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from memory_saving_gradients._src.models import common, transformers

Block = Callable[[tf.Tensor], tf.Tensor]
Wrap = Callable[[Block], Block]

#: Classes of every classifier here.
CLASSES = 10
#: Tokens of the transformer's vocabulary.
VOCABULARY = 1000
#: Attention heads of each transformer block.
HEADS = 4


def unwrapped(block: Block) -> Block:
    """The `wrap` that applies blocks as they are."""
    return block


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes every model takes: batch, layer width (units, channels or model dimension),
    input size (image side or sequence length) and dtype (a Keras dtype policy:
    float32, mixed_bfloat16, mixed_float16, bfloat16 or float16)."""

    batch: int
    width: int
    size: int
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class Model:
    """A model's trainable variables and the training loss of one batch.

    Attributes:
      depth: the depth the tables report: layers, blocks or levels, as `--depths` counts
        them; for a keras.applications model, its number of Keras layers.
      variables: the variables gradients are taken for.
      loss: `loss(wrap)` builds the forward pass, each block passed through `wrap`, and
        returns the float32 scalar loss.
      block_layers: the names of the Keras layers that are its blocks, where each block is
        one (a keras-hub backbone's decoder blocks): what per-block checkpoints keep.
    """

    depth: int
    variables: Sequence[tf.Variable]
    loss: Callable[[Wrap], tf.Tensor]
    block_layers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Kind:
    """A family of models: its builder, what its depth counts, its default sizes, and
    whether it is made of blocks (else its loss never calls `wrap`), whether its blocks are
    Keras layers (`Model.block_layers`), whether it is built at the depth it is given (a
    keras.applications model has its own), and whether its size is a sequence length."""

    build: Callable[[int, Shape], Model]
    depth_counts: str
    depths: tuple[int, ...]
    batch: int
    width: int
    size: int
    has_blocks: bool = True
    has_block_layers: bool = False
    takes_depth: bool = True
    sequence: bool = False


def _chain(depth: int, shape: Shape) -> Model:
    """tanh(matmul) layers of `width` units, the workload of the original library's demo; its
    weights and compute take the dtypes of the Keras policy `shape.dtype`, as a layer's do."""
    rng = np.random.default_rng(0)
    width = shape.width
    policy = keras.DTypePolicy(shape.dtype)
    weights = [common.fan_in_normal(rng, (width, width)) for _ in range(depth)]
    if policy.variable_dtype != "float32":
        weights = [tf.Variable(tf.cast(w, policy.variable_dtype)) for w in weights]
    x = tf.constant(rng.standard_normal((shape.batch, width)).astype("f4"))
    compute = tf.as_dtype(policy.compute_dtype)

    def layer(w: tf.Variable) -> Block:
        return lambda h: tf.tanh(tf.matmul(h, tf.cast(w, compute)))

    def loss(wrap: Wrap) -> tf.Tensor:
        h = _in_groups([layer(w) for w in weights], wrap)(tf.cast(x, compute))
        return tf.reduce_mean(tf.square(tf.cast(h, tf.float32)))

    return Model(depth, weights, loss)


def _resnet(depth: int, shape: Shape) -> Model:
    """Basic residual blocks (conv, batch norm, ReLU, conv, batch norm, add, ReLU)."""
    layers = keras.layers
    stem = layers.Conv2D(shape.width, 3, padding="same", activation="relu")

    def block() -> Block:
        parts = [
            layers.Conv2D(shape.width, 3, padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.Conv2D(shape.width, 3, padding="same", use_bias=False),
            layers.BatchNormalization(),
        ]
        return lambda h: tf.nn.relu(h + _through(parts, h))

    blocks = [block() for _ in range(depth)]

    def features(images: tf.Tensor, wrap: Wrap) -> tf.Tensor:
        return _in_groups(blocks, wrap)(stem(images))

    return _classifier(depth, _images(shape), features)


def _densenet(depth: int, shape: Shape) -> Model:
    """One dense block of `depth` layers (batch norm, ReLU, 1x1 conv, batch norm, ReLU, 3x3
    conv), each adding `width` channels to all those before it."""
    layers = keras.layers
    growth = shape.width
    stem = layers.Conv2D(2 * growth, 3, padding="same", use_bias=False)

    def dense_layer() -> Block:
        parts = [
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.Conv2D(4 * growth, 1, use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.Conv2D(growth, 3, padding="same", use_bias=False),
        ]
        return lambda h: tf.concat([h, _through(parts, h)], axis=-1)

    blocks = [dense_layer() for _ in range(depth)]

    def features(images: tf.Tensor, wrap: Wrap) -> tf.Tensor:
        return _in_groups(blocks, wrap)(stem(images))

    return _classifier(depth, _images(shape), features)


def _unet(depth: int, shape: Shape) -> Model:
    """A U-Net of `depth` levels: double convolutions, max pooling down, transposed
    convolutions up, skip connections by concatenation, and a per-pixel loss."""
    layers = keras.layers
    channels = [shape.width * 2**level for level in range(depth)]

    def double_conv(filters: int) -> Block:
        parts = []
        for _ in range(2):
            parts += [
                layers.Conv2D(filters, 3, padding="same", use_bias=False),
                layers.BatchNormalization(),
                layers.ReLU(),
            ]
        return lambda h: _through(parts, h)

    down = [double_conv(c) for c in channels]
    ups = [layers.Conv2DTranspose(c, 2, strides=2) for c in channels[:-1]]
    up = [double_conv(c) for c in channels[:-1]]
    head = layers.Conv2D(CLASSES, 1)
    pool = layers.MaxPooling2D(2)
    images = _images(shape)
    labels = tf.constant(common.labels(shape.batch * shape.size * shape.size, CLASSES))
    labels = tf.reshape(labels, (shape.batch, shape.size, shape.size))

    def logits(x: tf.Tensor, wrap: Wrap) -> tf.Tensor:
        skips = []
        h = x
        for level, block in enumerate(down):
            h = wrap(block)(h)
            if level < depth - 1:
                skips.append(h)
                h = pool(h)
        for level in reversed(range(depth - 1)):
            h = tf.concat([skips[level], ups[level](h)], axis=-1)
            h = wrap(up[level])(h)
        return head(h)

    def loss(wrap: Wrap) -> tf.Tensor:
        return common.cross_entropy(labels, logits(images, wrap))

    return Model(depth, _variables_read_by(lambda: logits(images[:1], unwrapped)), loss)


def _transformer(depth: int, shape: Shape) -> Model:
    """Pre-norm encoder blocks (multi-head attention, GELU MLP) over `size` tokens of
    `width` dimensions, classifying the mean token."""
    layers = keras.layers
    dim = shape.width
    embed = layers.Embedding(VOCABULARY, dim)
    positions = layers.Embedding(shape.size, dim)

    def encoder_block() -> Block:
        attention_norm, mlp_norm = layers.LayerNormalization(), layers.LayerNormalization()
        attention = layers.MultiHeadAttention(num_heads=HEADS, key_dim=dim // HEADS)
        mlp = [layers.Dense(4 * dim, activation="gelu"), layers.Dense(dim)]

        def block(h: tf.Tensor) -> tf.Tensor:
            a = attention_norm(h)
            h = h + attention(a, a)
            return h + _through(mlp, mlp_norm(h))

        return block

    blocks = [encoder_block() for _ in range(depth)]
    final_norm = layers.LayerNormalization()
    tokens = tf.constant(
        np.random.default_rng(0).integers(0, VOCABULARY, (shape.batch, shape.size))
    )

    def features(ids: tf.Tensor, wrap: Wrap) -> tf.Tensor:
        h = embed(ids) + positions(tf.range(shape.size))
        return tf.reduce_mean(final_norm(_in_groups(blocks, wrap)(h)), axis=1)

    return _classifier(depth, tokens, features)


def _causal_lm(family: str) -> Callable[[int, Shape], Model]:
    """The builder of a keras-hub causal LM of `family` (`transformers.HUB_FAMILIES`): `depth`
    decoder blocks of `width` hidden units and `HEADS` heads over `size` tokens, trained on
    the next token."""

    def build(depth: int, shape: Shape) -> Model:
        task = transformers.causal_lm(
            family, depth, shape.width, HEADS, shape.size, shape.batch, batches=1
        )
        lm, inputs = task.model, task.x
        assert isinstance(inputs, dict)  # a causal LM's token ids and padding mask
        x = {name: tf.constant(value) for name, value in inputs.items()}
        y = tf.constant(task.y)

        def loss(_wrap: Wrap) -> tf.Tensor:
            return common.cross_entropy(y, lm(x, training=True))

        first = {name: value[:1] for name, value in x.items()}
        variables = _variables_read_by(lambda: lm(first, training=True))
        return Model(depth, variables, loss, transformers.decoder_blocks(lm))

    return build


def application(name: str) -> Callable[[int, Shape], Model]:
    """The builder of `keras.applications.<name>` (weights=None, `size` x `size` RGB
    images); it ignores the depth it is given."""

    def build(_depth: int, shape: Shape) -> Model:
        network = getattr(keras.applications, name)(
            weights=None,
            input_shape=(shape.size, shape.size, 3),
            classes=CLASSES,
            classifier_activation=None,
        )
        images = _images(shape)
        labels = tf.constant(common.labels(shape.batch, CLASSES))

        def loss(_wrap: Wrap) -> tf.Tensor:
            return common.cross_entropy(labels, network(images, training=True))

        variables = _variables_read_by(lambda: network(images[:1], training=True))
        return Model(len(network.layers), variables, loss)

    return build


#: Each kind's sizes make activations outweigh weights (the chain's batch is eight times its
#: width), as in the deep models checkpointing is for.
KINDS: dict[str, Kind] = {
    "chain": Kind(_chain, "layers", (8, 16, 32, 64), batch=2048, width=256, size=0),
    "resnet": Kind(_resnet, "residual blocks", (4, 8, 16, 32), batch=8, width=16, size=32),
    "densenet": Kind(_densenet, "dense layers", (4, 8, 16), batch=8, width=12, size=32),
    "unet": Kind(_unet, "levels", (2, 3, 4), batch=4, width=8, size=64),
    "transformer": Kind(
        _transformer, "encoder blocks", (2, 4, 8), batch=8, width=64, size=128, sequence=True
    ),
    **{
        family: Kind(
            _causal_lm(family), "decoder blocks", (2, 4, 8), batch=4, width=128, size=256,
            has_blocks=False, has_block_layers=True, sequence=True,
        )
        for family in transformers.HUB_FAMILIES
    },
}  # fmt: skip
#: Defaults for keras.applications models: one build at their own depth (the 0 is ignored),
#: images large enough for most of them.
APPLICATION = Kind(
    application(""), "Keras layers", (0,), batch=4, width=0, size=96, has_blocks=False,
    takes_depth=False,
)  # fmt: skip


def application_names() -> list[str]:
    """The model functions of `keras.applications` (ResNet50, MobileNetV2, ...)."""
    return sorted(
        name
        for name in dir(keras.applications)
        if name[:1].isupper() and callable(getattr(keras.applications, name))
    )


def kind_of(name: str) -> Kind:
    """The kind of model `name` names: one of KINDS, or a keras.applications function."""
    if name in KINDS:
        return KINDS[name]
    return dataclasses.replace(APPLICATION, build=application(name))


def build(name: str, depth: int, shape: Shape) -> Model:
    """A fresh model (same seed every time) with its variables made where it is called."""
    keras.utils.set_random_seed(0)
    with dtype_policy(shape.dtype):
        return kind_of(name).build(depth, shape)


@contextlib.contextmanager
def dtype_policy(dtype: str) -> Iterator[None]:
    """Keras layers made inside take `dtype` as their policy (mixed_bfloat16: bfloat16
    compute, float32 variables)."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def _in_groups(blocks: Sequence[Block], wrap: Wrap) -> Block:
    """The blocks one after the other, wrapped in groups of about sqrt(len(blocks))."""
    size = max(1, round(math.sqrt(len(blocks))))
    groups = [blocks[start : start + size] for start in range(0, len(blocks), size)]

    def run(h: tf.Tensor) -> tf.Tensor:
        for group in groups:
            h = wrap(_chained(group))(h)
        return h

    return run


def _chained(parts: Sequence[Callable]) -> Block:
    """`parts` as one block."""

    def run(h: tf.Tensor) -> tf.Tensor:
        return _through(parts, h)

    return run


def _through(parts: Sequence[Callable], h: tf.Tensor) -> tf.Tensor:
    """`h` through `parts` in turn, Keras layers in training mode."""
    for part in parts:
        h = part(h, training=True) if isinstance(part, keras.layers.Layer) else part(h)
    return h


def _classifier(
    depth: int, inputs: tf.Tensor, features: Callable[[tf.Tensor, Wrap], tf.Tensor]
) -> Model:
    """A classifier: `features` (pooled over space where they are images) into logits by a
    Dense layer, trained with cross-entropy on fixed labels."""
    dense = keras.layers.Dense(CLASSES)
    labels = tf.constant(common.labels(inputs.shape[0], CLASSES))

    def logits(x: tf.Tensor, wrap: Wrap) -> tf.Tensor:
        h = features(x, wrap)
        if h.shape.rank == 4:
            h = tf.reduce_mean(h, axis=(1, 2))
        return dense(h)

    def loss(wrap: Wrap) -> tf.Tensor:
        return common.cross_entropy(labels, logits(inputs, wrap))

    return Model(depth, _variables_read_by(lambda: logits(inputs[:1], unwrapped)), loss)


def _variables_read_by(forward: Callable[[], object]) -> list[tf.Variable]:
    """The trainable variables `forward()` reads, made by that call where they do not exist
    yet (Keras layers build on their first call)."""
    with tf.GradientTape() as tape:
        forward()
    return list(tape.watched_variables())


def _images(shape: Shape) -> tf.Tensor:
    return tf.constant(common.images(1, shape.batch, shape.size))
