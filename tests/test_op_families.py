"""Checkpointed gradients equal tf.gradients on the op families users write between layers.

Each case is a residual chain of blocks built from one family of TensorFlow ops (linear
algebra, FFTs, sparse and ragged tensors, random ops, gradients inside the forward pass, ...),
differentiated by `tf.gradients` and by every strategy in one graph, so stateful ops (a dropout
mask, an assign) run once for all of them. Run in a Session (as TF1 programs run: this file is
also in the TF1 slice), inside a `tf.function`, and compiled by XLA.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.helpers import assert_same_gradients

tf1 = tf.compat.v1
STRATEGIES = ["memory", "speed", "balanced"]
BATCH, WIDTH, BLOCKS = 8, 32, 6


@dataclass(frozen=True)
class Case:
    block: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
    x_shape: tuple[int, ...] = (BATCH, WIDTH)
    w_shape: tuple[int, ...] = (WIDTH, WIDTH)
    rtol: float = 1e-5
    #: Whether XLA compiles the block (it has no kernel for a sparse-dense matmul).
    compiles: bool = True
    #: Whether 'speed' saves memory on a chain of blocks: not where what it keeps (the
    #: outputs of both matmuls of the sparse block) is as large as what plain backprop holds,
    #: so it recomputes nothing (`search.as_it_ran_first`).
    speed_pays: bool = True


def gradient_penalty(h, w):
    """A gradient taken inside the forward pass (WGAN-GP, double backprop)."""
    inner = tf.gradients(tf.reduce_sum(tf.sin(h @ w)), h)[0]
    return h + tf.tanh(h @ w) + 0.1 * inner


def linear_algebra(h, w):
    gram = tf.eye(WIDTH) + 0.1 * w @ tf.transpose(w)
    solved = tf.linalg.cholesky_solve(tf.linalg.cholesky(gram), tf.transpose(h))
    return tf.tanh(h @ tf.linalg.inv(gram) + tf.transpose(solved))


def fourier(h, w):
    spectrum = tf.signal.fft(tf.complex(h @ w, tf.zeros_like(h)))
    return tf.math.real(tf.signal.ifft(spectrum * tf.complex(tf.cos(h), tf.sin(h))))


def gather_scatter(h, w):
    reversed_h = tf.gather(h, tf.range(WIDTH)[::-1], axis=1)
    top = tf.math.top_k(h, 1).indices[:, 0]
    scattered = tf.scatter_nd(tf.stack([tf.range(BATCH), top], 1), tf.reduce_max(h, 1), h.shape)
    return tf.nn.relu(tf.einsum("bi,ij->bj", reversed_h, w)) + scattered + h


def resized_convolution(h, w):
    return tf.image.resize(tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME")), (16, 16), "bilinear")


def volume(h, w):
    padded = tf.pad(
        tf.nn.elu(tf.nn.conv3d(h, w, [1] * 5, "SAME")), [[0, 0]] + [[0, 1]] * 3 + [[0, 0]]
    )
    return tf.nn.avg_pool3d(padded, 2, 1, "VALID")


def fused_batch_norm(h, w):
    normalized, _, _ = tf1.nn.fused_batch_norm(
        tf.nn.conv2d(h, w, 1, "SAME"), tf.ones(8), tf.zeros(8), is_training=True
    )
    return tf.nn.relu(normalized) + h


def sparse(h, w):
    doubling = tf.sparse.from_dense(tf.eye(WIDTH) * 2.0)
    return tf.tanh(tf.transpose(tf.sparse.sparse_dense_matmul(doubling, tf.transpose(h @ w))))


def ragged(h, w):
    rows = tf.RaggedTensor.from_row_lengths(tf.reshape(h, [-1]), tf.fill([BATCH], WIDTH))
    return tf.tanh(h @ w) + tf.reduce_sum(rows, axis=1)[:, None]


def dropout(h, w):
    return tf.nn.dropout(tf.tanh(h @ w), rate=0.3) + h


def stateless_noise(h, w):
    return tf.tanh(h @ w) * tf.random.stateless_uniform(h.shape, seed=[1, 2]) + h


def sorted_sums(h, w):
    return tf.math.cumsum(tf.sort(tf.tanh(h @ w), axis=1), axis=1) / WIDTH + h


def assigned(h, w):
    """Each block moves its weight before reading it: backprop reads the moved value."""
    return tf.tanh(h @ w.assign_add(tf.fill(w.shape, 0.01))) + h


def half_precision(h, w):
    half = tf.cast(tf.nn.gelu(tf.cast(h, tf.float16) @ tf.cast(w, tf.float16)), tf.float32)
    brain = tf.cast(tf.nn.silu(tf.cast(h, tf.bfloat16) @ tf.cast(w, tf.bfloat16)), tf.float32)
    return tf.tanh(half + brain) + h


CASES = {
    "gradient penalty": Case(gradient_penalty),
    "linear algebra": Case(linear_algebra),
    "fourier": Case(fourier),
    "gather and scatter": Case(gather_scatter),
    "resized convolution": Case(resized_convolution, (2, 16, 16, 8), (3, 3, 8, 8)),
    "volume": Case(volume, (2, 8, 8, 8, 4), (3, 3, 3, 4, 4)),
    "fused batch norm": Case(fused_batch_norm, (2, 8, 8, 8), (3, 3, 8, 8)),
    "sparse": Case(sparse, compiles=False, speed_pays=False),
    "ragged": Case(ragged),
    "dropout": Case(dropout),
    "stateless noise": Case(stateless_noise),
    "sorted sums": Case(sorted_sums),
    "assigned": Case(assigned),
    "half precision": Case(half_precision, rtol=2e-3),
}


def all_gradients(
    case: Case, weights: list, x: tf.Tensor, always_recomputes: bool = True
) -> tuple[list, list[list]]:
    """tf.gradients and each strategy's of the chain's loss, in the default graph. Asserts
    that each strategy recomputes some ops (so that the rewrite is what is compared; 'speed'
    where it saves memory on the case's blocks, `Case.speed_pays`), or with
    `always_recomputes=False`, that it does exactly where its plan pays."""
    h = x
    for w in weights:
        h = case.block(h, w)
    loss = tf.reduce_sum(h * h)
    graph = tf1.get_default_graph()
    reference = tf.gradients(loss, weights)
    checkpointed = []
    for strategy in STRATEGIES:
        forced = always_recomputes and (strategy != "speed" or case.speed_pays)
        pays = forced or msg.plan(loss, weights, checkpoints=strategy).pays
        first = len(graph.get_operations())
        checkpointed.append(msg.gradients(loss, weights, checkpoints=strategy))
        made = graph.get_operations()[first:]
        recomputed = any("/recompute_" in op.name for op in made)
        assert recomputed == pays, f"{strategy!r}: recomputes {recomputed}, its plan pays {pays}"
    return reference, checkpointed


def chain_inputs(case: Case) -> tuple[list, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = [
        tf.Variable((rng.standard_normal(case.w_shape) * 0.2).astype(np.float32))
        for _ in range(BLOCKS)
    ]
    return weights, rng.standard_normal(case.x_shape).astype(np.float32)


def assert_all_equal(case: Case, reference, checkpointed) -> None:
    scale = max(float(np.abs(r).max()) for r in reference)
    assert np.isfinite(scale), "the reference gradients overflow"
    for strategy, got in zip(STRATEGIES, checkpointed, strict=True):
        try:
            assert_same_gradients(reference, got, rtol=case.rtol, atol=case.rtol * scale)
        except AssertionError as error:
            raise AssertionError(f"checkpoints={strategy!r}: {error}") from error


@pytest.mark.parametrize("name", CASES)
def test_in_a_session(name):
    case = CASES[name]
    with tf.Graph().as_default():
        weights, x = chain_inputs(case)
        reference, checkpointed = all_gradients(case, weights, tf.constant(x))
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            reference, checkpointed = session.run((reference, checkpointed))
    assert_all_equal(case, reference, checkpointed)


@pytest.mark.tf2_only
@pytest.mark.parametrize("name", CASES)
def test_in_a_tf_function(name):
    case = CASES[name]
    weights, x = chain_inputs(case)

    @tf.function
    def step():
        return all_gradients(case, weights, tf.constant(x))

    reference, checkpointed = tf.nest.map_structure(lambda t: t.numpy(), step())
    assert_all_equal(case, reference, checkpointed)


@pytest.mark.tf2_only
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.compiles])
def test_compiled_by_xla(name):
    """Under XLA a gate copies what a matmul reads (NOTE [gates under XLA]), so on these
    1 KiB activations some plans predict no saving (on the dropout, stateless-noise and
    assigned chains) and fall back to plain gradients."""
    case = CASES[name]
    weights, x = chain_inputs(case)

    @tf.function(jit_compile=True)
    def step():
        return all_gradients(case, weights, tf.constant(x), always_recomputes=False)

    reference, checkpointed = tf.nest.map_structure(lambda t: t.numpy(), step())
    assert_all_equal(case, reference, checkpointed)
