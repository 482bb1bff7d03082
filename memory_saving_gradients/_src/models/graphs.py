"""Small models of raw TensorFlow ops, each buildable in a Session graph and a tf.function: what
the gradient-equality tests compare checkpointed gradients with `tf.gradients` on.

Batches are large enough that activations, not weight gradients, make the predicted peak: on
a model where they do not, 'balanced' rightly recomputes nothing.

A model function creates its variables where it is called (inside a `tf.Graph` for a Session,
eagerly for a `tf.function`) and returns a `Model`: `forward(x)` builds the forward pass and
returns the ys and the tensors a test may checkpoint explicitly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from memory_saving_gradients._src.models import common

Forward = Callable[[tf.Tensor], tuple[list[tf.Tensor], list[tf.Tensor]]]


@dataclasses.dataclass
class Model:
    """A model's variables, its forward pass and an input batch to feed it."""

    variables: list[tf.Variable]
    forward: Forward
    x: np.ndarray


def tanh_chain(depth: int = 6, width: int = 16, batch: int = 64) -> Model:
    rng = np.random.RandomState(0)
    ws = [common.fan_in_normal(rng, [width, width], f"w{i}") for i in range(depth)]

    def forward(x):
        h, kept = x, []
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
            kept.append(h)
        return [tf.reduce_sum(h * h)], kept[1::2]

    return Model(ws, forward, rng.randn(batch, width).astype(np.float32))


def residual_chain(depth: int = 6, width: int = 16, batch: int = 64) -> Model:
    rng = np.random.RandomState(1)
    ws = [common.fan_in_normal(rng, [width, width], f"w{i}") for i in range(depth)]

    def forward(x):
        h, kept = x, []
        for w in ws:
            h = h + tf.tanh(tf.matmul(h, w))
            kept.append(h)
        return [tf.reduce_mean(tf.square(h))], kept[::2]

    return Model(ws, forward, rng.randn(batch, width).astype(np.float32))


def conv_batchnorm_relu(blocks: int = 3, channels: int = 4) -> Model:
    rng = np.random.RandomState(2)
    kernels = [
        common.fan_in_normal(rng, [3, 3, channels, channels], f"k{i}") for i in range(blocks)
    ]
    scales = [tf.Variable(np.ones(channels, np.float32), name=f"s{i}") for i in range(blocks)]
    offsets = [tf.Variable(np.zeros(channels, np.float32), name=f"o{i}") for i in range(blocks)]
    dense = common.fan_in_normal(rng, [4 * 4 * channels, 3], "dense")

    def forward(x):
        h, kept = x, []
        for k, s, o in zip(kernels, scales, offsets, strict=True):
            h = tf.nn.conv2d(h, k, strides=1, padding="SAME")
            h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, s, o, is_training=True)
            h = tf.nn.relu(h)
            kept.append(h)
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        logits = tf.matmul(tf.reshape(h, [-1, 4 * 4 * channels]), dense)
        labels = tf.one_hot([0, 1, 2, 1], 3)
        loss = tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return [tf.reduce_mean(loss)], kept

    variables = [*kernels, *scales, *offsets, dense]
    return Model(variables, forward, rng.randn(4, 8, 8, channels).astype(np.float32))


def several_ys(depth: int = 5, width: int = 12, batch: int = 48) -> Model:
    """Two heads on one trunk; ys include an intermediate tensor of the trunk."""
    rng = np.random.RandomState(3)
    ws = [common.fan_in_normal(rng, [width, width], f"w{i}") for i in range(depth)]
    head = common.fan_in_normal(rng, [width, 2], "head")

    def forward(x):
        h, kept = x, []
        for w in ws:
            h = tf.nn.relu(tf.matmul(h, w)) + 0.1 * h
            kept.append(h)
        middle = kept[depth // 2]
        return [tf.reduce_sum(tf.matmul(h, head)), tf.reduce_sum(tf.sin(h)), middle], kept[::2]

    return Model([*ws, head], forward, rng.randn(batch, width).astype(np.float32))


def dropout_chain(depth: int = 6, width: int = 32, batch: int = 64) -> Model:
    """Dropout without a seed: recomputing its mask would change the gradient."""
    rng = np.random.RandomState(4)
    ws = [common.fan_in_normal(rng, [width, width], f"w{i}") for i in range(depth)]

    def forward(x):
        h, kept = x, []
        for w in ws:
            h = tf.nn.dropout(tf.tanh(tf.matmul(h, w)), rate=0.5)
            kept.append(h)
        return [tf.reduce_sum(h * h)], kept[1::2]

    return Model(ws, forward, rng.randn(batch, width).astype(np.float32))


def embedding_model(vocab: int = 50, dim: int = 8, depth: int = 4) -> Model:
    """An embedding lookup, whose table gradient tf.gradients gives as IndexedSlices."""
    rng = np.random.RandomState(5)
    table = tf.Variable(rng.randn(vocab, dim).astype(np.float32), name="table")
    ws = [common.fan_in_normal(rng, [dim, dim], f"w{i}") for i in range(depth)]

    def forward(ids):
        h, kept = tf.nn.embedding_lookup(table, ids), []
        for w in ws:
            h = tf.tanh(tf.einsum("bsd,de->bse", h, w))
            kept.append(h)
        return [tf.reduce_sum(h * h)], kept[::2]

    return Model([table, *ws], forward, rng.randint(0, vocab, size=(4, 6)).astype(np.int32))


def float16_region(depth: int = 6, width: int = 16, batch: int = 64) -> Model:
    """A float32 model whose middle layers run in float16 between two casts."""
    rng = np.random.RandomState(6)
    ws = [common.fan_in_normal(rng, [width, width], f"w{i}") for i in range(depth)]

    def forward(x):
        h, kept = tf.tanh(tf.matmul(x, ws[0])), []
        h = tf.cast(h, tf.float16)
        for w in ws[1:-1]:
            h = tf.tanh(tf.matmul(h, tf.cast(w, tf.float16)))
            kept.append(h)
        h = tf.tanh(tf.matmul(tf.cast(h, tf.float32), ws[-1]))
        return [tf.reduce_sum(h * h)], kept[::2]

    return Model(ws, forward, rng.randn(batch, width).astype(np.float32))


def while_loop_model(steps: int = 4, width: int = 16, batch: int = 64) -> Model:
    """A `tf.while_loop` (control flow v2) between ordinary layers."""
    rng = np.random.RandomState(7)
    before = [common.fan_in_normal(rng, [width, width], f"before{i}") for i in range(3)]
    w_loop = common.fan_in_normal(rng, [width, width], "loop")
    after = [common.fan_in_normal(rng, [width, width], f"after{i}") for i in range(3)]

    def forward(x):
        h = x
        for w in before:
            h = tf.tanh(tf.matmul(h, w))
        _, h = tf.while_loop(
            lambda i, a: i < steps, lambda i, a: (i + 1, tf.tanh(tf.matmul(a, w_loop))), (0, h)
        )
        kept = [h]
        for w in after:
            h = tf.tanh(tf.matmul(h, w))
            kept.append(h)
        return [tf.reduce_sum(h * h)], kept[:2]

    return Model([*before, w_loop, *after], forward, rng.randn(batch, width).astype(np.float32))


ALL = {
    "tanh_chain": tanh_chain,
    "residual_chain": residual_chain,
    "conv_batchnorm_relu": conv_batchnorm_relu,
    "several_ys": several_ys,
    "dropout_chain": dropout_chain,
    "embedding_model": embedding_model,
    "float16_region": float16_region,
    "while_loop_model": while_loop_model,
}
