"""TF1 programs, as users of the original library run them on TensorFlow 2.

Collected only by tests/test_tf1_behaviour.py, which runs this module (and a slice of the
suite) in a fresh interpreter under `tf.compat.v1.disable_v2_behavior()`: V1 shapes whose
dimensions are `Dimension` objects, reference variables from `get_variable`, TF1 control
flow (Switch/Merge frames), Sessions and `tf.compat.v1.train` optimizers.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory
from tests.helpers import assert_recomputes_where_it_pays, assert_same_gradients

tf1 = tf.compat.v1
STRATEGIES = ["memory", "balanced", "speed"]


def test_this_module_runs_as_tf1_programs_do():
    assert not tf.executing_eagerly()
    assert not tf1.control_flow_v2_enabled()
    assert not tf1.resource_variables_enabled()
    with tf.Graph().as_default():
        assert type(tf1.placeholder(tf.float32, [None, 3]).shape[1]).__name__ == "Dimension"


def reference_variable_chain(depth: int = 12, width: int = 64, batch=None):
    """tanh(matmul) layers on `get_variable` weights (reference variables) fed by a
    placeholder whose batch dimension is unknown."""
    x = tf1.placeholder(tf.float32, [batch, width], name="x")
    initializer = tf1.random_normal_initializer(0.0, 1.0 / np.sqrt(width), seed=0)
    ws = [tf1.get_variable(f"w{i}", [width, width], initializer=initializer) for i in range(depth)]
    h = x
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return x, ws, tf.reduce_sum(h * h)


def feed(x, rows: int = 256):
    return {x: np.random.default_rng(1).standard_normal((rows, x.shape[1])).astype("f4")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_issues_chain(strategy):
    """The issue's program: 'memory' and 'balanced' raised "unhashable type: 'Dimension'"."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, (4, 3))
        w = tf1.Variable(tf.ones((3, 3)))
        h = x
        for _ in range(6):
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h)
        reference = tf1.gradients(loss, [w])
        got = msg.gradients(loss, [w], checkpoints=strategy)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            want, have = session.run([reference, got], {x: np.full((4, 3), 0.1, "f4")})
    assert_same_gradients(want, have)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reference_variables_and_unknown_batch(strategy):
    with tf.Graph().as_default():
        x, ws, loss = reference_variable_chain()
        assert all(w.dtype._is_ref_dtype for w in ws)
        reference = tf1.gradients(loss, ws)
        plan = msg.plan(loss, ws, checkpoints=strategy)
        got = msg.gradients(loss, ws, checkpoints=strategy)
        assert_recomputes_where_it_pays(plan)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            want, have = session.run([reference, got], feed(x))
    assert_same_gradients(want, have)


OPTIMIZERS = {
    "sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
    "adam": lambda: tf1.train.AdamOptimizer(0.01),
}


def batch_norm_network(training: bool = True):
    """conv, fused batch norm (TF1's op, moving averages updated by assigns to reference
    variables in UPDATE_OPS), ReLU, a TF1 cond and a TF1 while loop, on `get_variable`s."""
    x = tf1.placeholder(tf.float32, [None, 8, 8, 4], name="images")
    h = x
    for i in range(4):
        with tf1.variable_scope(f"block{i}"):
            kernel = tf1.get_variable("kernel", [3, 3, 4, 4])
            scale = tf1.get_variable("scale", [4], initializer=tf1.ones_initializer())
            offset = tf1.get_variable("offset", [4], initializer=tf1.zeros_initializer())
            mean = tf1.get_variable(
                "mean", [4], initializer=tf1.zeros_initializer(), trainable=False
            )
            variance = tf1.get_variable(
                "variance", [4], initializer=tf1.ones_initializer(), trainable=False
            )
            r = tf.nn.conv2d(h, kernel, 1, "SAME")
            r, batch_mean, batch_variance = tf1.nn.fused_batch_norm(
                r, scale, offset, mean=None if training else mean,
                variance=None if training else variance, is_training=training,
            )  # fmt: skip
            if training:
                for average, value in ((mean, batch_mean), (variance, batch_variance)):
                    update = tf1.assign_sub(average, 0.1 * (average - value))
                    tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
            h = tf.nn.relu(h + r)
    h = tf1.cond(tf.reduce_mean(h) > 0, lambda: tf.sin(h), lambda: tf.cos(h))
    _, h = tf1.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, tf.tanh(v) * 0.9), [0, h])
    return x, tf.reduce_mean(tf.square(h))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_patched_v1_optimizers_minimize_as_tensorflow_does(optimizer):
    """`Optimizer.minimize` differentiates against the variables' reference tensors; the
    variables after two steps equal those of TensorFlow's own gradients."""

    def train(patched: bool):
        with tf.Graph().as_default():
            tf1.set_random_seed(3)
            x, loss = batch_norm_network()
            with tf1.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                if patched:
                    with msg.patched("memory"):
                        step = OPTIMIZERS[optimizer]().minimize(loss)
                else:
                    step = OPTIMIZERS[optimizer]().minimize(loss)
            graph = tf1.get_default_graph()
            recomputed = any("/recompute_" in op.name for op in graph.get_operations())
            images = {x: np.random.default_rng(2).standard_normal((16, 8, 8, 4)).astype("f4")}
            with tf1.Session() as session:
                session.run(tf1.global_variables_initializer())
                for _ in range(2):
                    session.run(step, images)
                return session.run(tf1.global_variables()), recomputed

    want, _ = train(patched=False)
    have, recomputed = train(patched=True)
    assert recomputed
    assert_same_gradients(want, have)


def test_hessians_build_their_gradients_in_a_tf1_while_loop():
    """`tf.compat.v1.hessians` calls tf.gradients inside a TF1 while loop, whose frames
    recomputed ops cannot enter: TensorFlow's own gradients there (a gate outside the loop
    read a gradient inside it and the graph was refused); the gradient outside is
    checkpointed."""
    rng = np.random.default_rng(0)
    with tf.Graph().as_default():
        x = tf.constant(rng.standard_normal(4).astype("f4"))
        h = tf.tile(x[None, :], [1024, 64])
        for _ in range(8):
            h = tf.tanh(h @ tf.constant(rng.standard_normal((256, 256)).astype("f4") / 16))
        y = tf.reduce_sum(h)
        reference = tf1.hessians(y, x)
        with msg.patched("memory"):
            got = tf1.hessians(y, x)
        with tf1.Session() as session:
            want, have = session.run([reference, got])
    assert_same_gradients(want, have, rtol=1e-4)


def test_memory_saved_in_a_session():
    """A 32-layer chain on reference variables, SGD step in a Session: 'memory' at most a
    third of plain backprop's activation peak."""

    def peak(checkpoints) -> float:
        with tf.Graph().as_default() as graph:
            x, _, loss = reference_variable_chain(depth=32, width=256, batch=1024)
            with msg.patched(checkpoints) if checkpoints else contextlib.nullcontext():
                step = tf1.train.GradientDescentOptimizer(0.0).minimize(loss)
        config = tf1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
        with tf1.Session(graph=graph, config=config) as session:
            session.run(tf1.variables_initializer(graph.get_collection("variables")))
            values = feed(x, 1024)
            return min(peak_memory(lambda: session.run(step, values)) for _ in range(2))

    plain, checkpointed = peak(None), peak("memory")
    assert plain > 30 * 2**20
    assert checkpointed < plain / 3
