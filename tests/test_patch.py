"""Patching routes TensorFlow's gradient entry points to checkpointed gradients, and back."""

import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gradients as gradients_module
from tensorflow.python.ops import gradients_impl

import memory_saving_gradients as msg
from memory_saving_gradients._src import _tf
from tests.helpers import assert_recomputes, assert_same_gradients, values

tf1 = tf.compat.v1
ENTRY_POINTS = [
    (tf, "gradients"),
    (tf.compat.v2, "gradients"),
    (tf1, "gradients"),
    (gradients_impl, "gradients"),
    (gradients_module, "gradients"),
]


@pytest.fixture(autouse=True)
def restore_tensorflow():
    yield
    msg.unpatch()


def deep_chain(x, n=8):
    ws = [tf.Variable(np.eye(8, dtype=np.float32) * 0.9, name=f"w{i}") for i in range(n)]
    h = x
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return ws, tf.reduce_sum(h * h)


def count_recomputed_ops(graph):
    return sum("/recompute_" in op.name for op in graph.get_operations())


@pytest.mark.parametrize(("module", "attribute"), ENTRY_POINTS)
def test_patch_routes_every_entry_point(module, attribute):
    msg.patch("memory")
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, 8])
        ws, loss = deep_chain(x)
        getattr(module, attribute)(loss, ws)
        assert_recomputes(graph)
    msg.unpatch()
    assert getattr(module, attribute) is not None
    for point in _tf.GRADIENT_ENTRY_POINTS:
        assert getattr(point.module, point.attribute) is point.original


def test_patch_reaches_tf_compat_v2_made_anew(monkeypatch):
    """Importing keras-hub (through tensorflow-text) makes `tf.compat.v2` a new module object:
    a patch of the one seen when this library was imported left its `gradients` TensorFlow's."""
    anew = types.ModuleType("tensorflow.compat.v2")
    anew.gradients = tf.compat.v2.gradients
    monkeypatch.setattr(tf.compat, "v2", anew)
    msg.patch("memory")
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, 8])
        ws, loss = deep_chain(x)
        tf.compat.v2.gradients(loss, ws)
        assert_recomputes(graph)
    msg.unpatch()
    assert anew.gradients is _tf.GRADIENT_ENTRY_POINTS[1].original


def test_patched_functions_keep_tensorflows_positional_parameters():
    msg.patch("speed")
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, 8])
        ws, loss = deep_chain(x)
        grads_v2 = tf.gradients(loss, ws, None, "named_v2", True)  # 5th: gate_gradients
        grads_v1 = tf1.gradients(loss, ws, None, "named_v1", False, True)  # colocate, gate
        assert graph.get_name_scope() == ""
        assert any(op.name.startswith("named_v2") for op in graph.get_operations())
        assert any(op.name.startswith("named_v1") for op in graph.get_operations())
        assert len(grads_v2) == len(grads_v1) == len(ws)


def test_patched_context_restores_what_was_there():
    msg.patch("speed")
    speed_function = tf.gradients
    with msg.patched("memory"):
        assert tf.gradients is not speed_function
        with msg.patched("collection"):
            pass
        assert tf.gradients.__name__ == "checkpointed_gradients_v2"
    assert tf.gradients is speed_function
    msg.unpatch()
    with msg.patched():
        pass
    assert tf.gradients is gradients_impl.gradients_v2


def test_one_line_monkey_patch_from_the_readme(monkeypatch):
    """'speed' recomputes the GELUs of a chain large enough for that to pay (on a chain of
    tanhs there is nothing to gain: a matmul's output is as large as its tanh's)."""
    monkeypatch.setitem(tf.__dict__, "gradients", msg.gradients_speed)
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [256, 8])
        ws = [tf.Variable(np.eye(8, dtype=np.float32) * 0.9, name=f"w{i}") for i in range(8)]
        h = x
        for w in ws:
            h = tf.nn.gelu(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        reference = tf1.gradients(loss, ws)
        got = tf.gradients(loss, ws)
        assert_recomputes(graph)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            feed = {x: np.linspace(-2, 2, 256 * 8, dtype=np.float32).reshape(256, 8)}
            values = session.run([reference, got], feed)
    assert_same_gradients(*values)


def test_patched_optimizer_minimize_updates_like_plain():
    def train(patched):
        with tf.Graph().as_default() as graph:
            x = tf1.placeholder(tf.float32, [4, 8])
            ws, loss = deep_chain(x)
            if patched:
                with msg.patched("memory"):
                    train_op = tf1.train.AdamOptimizer(0.1).minimize(loss)
            else:
                train_op = tf1.train.AdamOptimizer(0.1).minimize(loss)
            recomputed = count_recomputed_ops(graph)
            with tf1.Session() as session:
                session.run(tf1.global_variables_initializer())
                for _ in range(3):
                    session.run(train_op, {x: np.ones((4, 8), np.float32)})
                return session.run(ws), recomputed

    plain, none_recomputed = train(patched=False)
    checkpointed, recomputed = train(patched=True)
    assert none_recomputed == 0 and recomputed > 0
    for want, have in zip(plain, checkpointed, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def test_patched_tf_gradients_inside_tf_function():
    x = tf.ones([4, 8])
    ws, _ = deep_chain(x)

    @tf.function
    def step():
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        reference = _tf.tensorflow_gradients(
            [loss], [w.handle for w in ws], None, name="reference",
            colocate_gradients_with_ops=True, gate_gradients=False,
            aggregation_method=None, stop_gradients=[],
        )  # fmt: skip
        got = tf.gradients(loss, ws)
        assert count_recomputed_ops(loss.graph) > 0
        return reference, got

    with msg.patched("memory"):
        reference, got = step()
    assert_same_gradients(*values([reference, got]))
