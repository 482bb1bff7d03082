"""State and randomness: never recomputed, never run twice, exact gradients.

Random ops (seeded or not), variable reads after assignments, tf.data iterators and batch-norm
moving averages all hold state. Recomputing them would change the values the backward pass
sees or advance the state twice, so the rewrite keeps their forward outputs instead. Stateless
random ops are recomputed: given the same seed they give the same numbers.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis.view import why_not_recomputable
from tests.helpers import (
    assert_recomputes,
    assert_same_gradients,
    recomputed_copies,
    run_with_nones,
    square_weights,
)

tf1 = tf.compat.v1
WIDTH = 16


def assert_nothing_stateful_recomputed(graph):
    stateful = [op.name for op in recomputed_copies(graph) if _tf.is_stateful(op)]
    assert not stateful, stateful


NOISE = {
    "uniform_unseeded": lambda h: h * tf.random.uniform(tf.shape(h)),
    "uniform_seeded": lambda h: h * tf.random.uniform(tf.shape(h), seed=7),
    "normal_unseeded": lambda h: h + tf.random.normal(tf.shape(h)),
    "dropout_unseeded": lambda h: tf.nn.dropout(h, rate=0.3),
    "stateless": lambda h: h * tf.random.stateless_uniform(tf.shape(h), seed=[1, 2]),
}


@pytest.mark.parametrize("strategy", ["memory", "list"])
@pytest.mark.parametrize("noise", sorted(NOISE))
def test_random_ops_in_the_forward_pass(noise, strategy):
    with tf.Graph().as_default() as graph:
        # An unknown batch size makes the noise shapes, tf.shape(h), depend on the forward pass.
        x = tf1.placeholder(tf.float32, [None, WIDTH])
        ws = square_weights(8, WIDTH)
        h, hidden = x, []
        for w in ws:
            h = NOISE[noise](tf.tanh(tf.matmul(h, w)))
            hidden.append(h)
        loss = tf.reduce_sum(h * h)
        reference = tf1.gradients(loss, ws)
        got = msg.gradients(loss, ws, checkpoints=hidden[1::3] if strategy == "list" else strategy)
        assert_recomputes(graph)
        assert_nothing_stateful_recomputed(graph)
        recomputed_types = {op.type for op in recomputed_copies(graph)}
        if noise == "stateless":
            assert "StatelessRandomUniformV2" in recomputed_types
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).randn(8, WIDTH).astype(np.float32)}
            values = run_with_nones(session, [reference, got], feed)
    assert_same_gradients(*values)


def test_variable_read_after_an_assignment_in_the_same_step():
    """The forward pass doubles a variable and reads it; the backward pass must see that read."""
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [8, WIDTH])
        ws = square_weights(6, WIDTH)
        scale = tf.Variable(np.ones(WIDTH, np.float32), name="scale")
        h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, ws[0])), ws[1]))
        doubled = scale.assign(scale * 2.0)
        with tf1.control_dependencies([doubled]):
            h = h * scale.read_value()
        for w in ws[2:]:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        xs = [*ws, scale]
        reference = tf1.gradients(loss, xs)
        got = msg.gradients(loss, xs, checkpoints="memory")
        assert_recomputes(graph)
        assert_nothing_stateful_recomputed(graph)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            feed = {x: np.ones((8, WIDTH), np.float32)}
            values = run_with_nones(session, [reference, got], feed)
            assert session.run(scale)[0] == 2.0, "the assignment ran once"
    assert_same_gradients(*values)


def test_tf_data_iterator_advances_once_per_step():
    data = np.arange(5 * 8 * WIDTH, dtype=np.float32).reshape(5, 8, WIDTH) / 100.0
    with tf.Graph().as_default() as graph:
        batch = tf1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(data)
        ).get_next()
        ws = square_weights(6, WIDTH)
        h = batch
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        reference = tf1.gradients(loss, ws)
        got = msg.gradients(loss, ws, checkpoints="memory")
        assert_recomputes(graph)
        assert_nothing_stateful_recomputed(graph)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            for _ in range(3):
                values = run_with_nones(session, [reference, got])
                assert_same_gradients(*values)
            np.testing.assert_array_equal(session.run(batch), data[3])


def conv_batch_norm_relu(h, i, rng):
    """A conv layer and a training-mode batch norm whose moving averages update each step."""
    channels = int(h.shape[-1])
    kernel = tf.Variable(rng.randn(3, 3, channels, 4).astype(np.float32) * 0.3, name=f"k{i}")
    scale = tf.Variable(np.ones(4, np.float32), name=f"scale{i}")
    offset = tf.Variable(np.zeros(4, np.float32), name=f"offset{i}")
    moving_mean = tf.Variable(np.zeros(4, np.float32), trainable=False, name=f"mean{i}")
    moving_var = tf.Variable(np.ones(4, np.float32), trainable=False, name=f"var{i}")
    h = tf.nn.conv2d(h, kernel, strides=1, padding="SAME")
    h, mean, variance = tf1.nn.fused_batch_norm(h, scale, offset, is_training=True)
    for average, batch_value in ((moving_mean, mean), (moving_var, variance)):
        update = average.assign(0.9 * average + 0.1 * batch_value)
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, update)
    return tf.nn.relu(h)


def train_with_batch_norm(checkpointed: bool, steps: int = 3):
    """Every variable after a few Momentum steps of a conv + batch-norm net."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, 8, 8, 3])
        h = x
        for i in range(4):
            h = conv_batch_norm_relu(h, i, rng)
        loss = tf.reduce_mean(tf.square(h))
        with tf1.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
            if checkpointed:
                with msg.patched("memory"):
                    train_op = optimizer.minimize(loss)
            else:
                train_op = optimizer.minimize(loss)
        assert bool(recomputed_copies(graph)) == checkpointed
        assert_nothing_stateful_recomputed(graph)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            for _ in range(steps):
                session.run(train_op, {x: rng.randn(4, 8, 8, 3).astype(np.float32)})
            return session.run(tf1.global_variables())


def test_batch_norm_moving_averages_and_optimizer_update_once_per_step():
    plain = train_with_batch_norm(checkpointed=False)
    checkpointed = train_with_batch_norm(checkpointed=True)
    for want, have in zip(plain, checkpointed, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def looped_chain(weights, x, read_inside: bool, random_inside: bool = False):
    """Blocks of a tf.while_loop of tanh(matmul), reading each weight inside the loop's body
    (the loop is stateful) or taking its value as a tensor (the loop is stateless)."""
    h = x
    for w in weights:
        value = w if read_inside else tf.convert_to_tensor(w)

        def body(i, a, value=value):
            step = tf.tanh(a @ value)
            if random_inside:
                step += tf.random.uniform(tf.shape(a), maxval=1e-3)
            return i + 1, step

        h = h + tf.while_loop(lambda i, a: i < 2, body, (0, h))[1]
    return tf.reduce_sum(h * h)


@pytest.mark.tf2_only
def test_loops_reading_variables_are_kept_and_named_with_what_to_do(caplog):
    """A while loop reading a variable inside is stateful, so it is not recomputed: the plan
    falls back to plain gradients and a warning says how to let it be recomputed. Given the
    value as a tensor, the loop is stateless and recomputed."""
    weights = square_weights(6, 64)
    x = tf.constant(np.random.default_rng(0).standard_normal((64, 64)).astype("f4"))

    @tf.function
    def step(read_inside):
        loss = looped_chain(weights, x, read_inside)
        with caplog.at_level("INFO", logger="memory_saving_gradients"):
            got = msg.gradients(loss, weights, checkpoints="memory")
        recomputed = recomputed_copies(tf1.get_default_graph())
        return tf.gradients(loss, weights), got, len(recomputed)

    want, got, recomputed = step(True)
    assert_same_gradients([w.numpy() for w in want], [g.numpy() for g in got])
    assert recomputed == 0
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "tf.convert_to_tensor(variable)" in warnings[0].message
    assert "6 loops, conds or nested tf.functions" in warnings[0].message

    caplog.clear()
    want, got, recomputed = step(False)
    assert_same_gradients([w.numpy() for w in want], [g.numpy() for g in got])
    assert recomputed > 0
    assert "read variables inside" not in caplog.text


@pytest.mark.tf2_only
def test_speed_names_the_loops_its_matmuls_run_in():
    """'speed' keeps matmul outputs; where every matmul runs inside a loop reading a variable,
    which is never recomputed, it refuses naming the loops and what to do, and with the
    values passed in as tensors keeps the loops' outputs."""
    weights = square_weights(3, 8)

    @tf.function
    def step(read_inside):
        loss = looped_chain(weights, tf.ones((4, 8)), read_inside)
        return msg.gradients(loss, weights, checkpoints="speed"), tf.gradients(loss, weights)

    with pytest.raises(
        msg.NoCheckpointsError, match=r"'while'.*reads variables inside.*convert_to_tensor"
    ):
        step(True)
    got, want = step(False)
    assert_same_gradients([w.numpy() for w in want], [g.numpy() for g in got])


@pytest.mark.tf2_only
def test_loops_with_other_state_inside_get_the_general_reason():
    """A loop drawing random numbers inside stays stateful whatever it is given."""
    weights = square_weights(2, 8)
    reasons = {}

    @tf.function
    def step():
        loss = looped_chain(weights, tf.ones((4, 8)), read_inside=False, random_inside=True)
        view = msg.plan(loss, weights, checkpoints="memory")._view
        assert not view.kept_for_variable_reads
        loops = [op for op in view.ops if op.type == "While"]
        reasons.update({op.name: why_not_recomputable(op, frozenset()) for op in loops})
        return loss

    step.get_concrete_function()
    assert len(reasons) == 2
    assert all(reason.startswith("it is stateful (random") for reason in reasons.values())
