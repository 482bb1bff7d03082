"""Repeated and nested use: many calls on one graph, higher-order gradients, no recursion."""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.helpers import assert_recomputes, assert_same_gradients, run_with_nones

tf1 = tf.compat.v1
WIDTH = 8


def chain(x, n=8, seed=0):
    rng = np.random.RandomState(seed)
    ws = [
        tf.Variable((rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32), name=f"w{i}")
        for i in range(n)
    ]
    h, hidden = x, []
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
        hidden.append(h)
    return ws, hidden, tf.reduce_sum(h * h)


def test_many_calls_on_one_graph_add_the_same_ops_each_time():
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws, hidden, loss = chain(x)
        added, results = [], []
        for _ in range(5):
            before = len(graph.get_operations())
            results.append(msg.gradients(loss, ws, checkpoints=hidden[2::3]))
            added.append(len(graph.get_operations()) - before)
        names = [op.name for op in graph.get_operations()]
        reference = tf1.gradients(loss, ws)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            values = run_with_nones(session, [reference, *results], {x: np.ones((4, WIDTH))})
    # The first call also makes the few int64 constants (the gates' slice sizes: one per
    # shape passed) and the unfoldable zero every gate of the graph shares.
    assert len(set(added[1:])) == 1, f"ops added per call differ: {added}"
    assert 0 <= added[0] - added[1] <= 8, f"first call added {added[0] - added[1]} more ops"
    assert len(names) == len(set(names))
    for got in values[1:]:
        assert_same_gradients(values[0], got)


def test_different_strategies_on_one_graph_do_not_interfere():
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws, hidden, loss = chain(x, n=10)
        msg.add_checkpoint(hidden[4])
        results = [
            msg.gradients(loss, ws, checkpoints=c) for c in ("memory", "speed", "collection")
        ]
        assert_recomputes(graph)
        reference = tf1.gradients(loss, ws)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            values = run_with_nones(session, [reference, *results], {x: np.ones((4, WIDTH))})
    for got in values[1:]:
        assert_same_gradients(values[0], got)


@pytest.mark.parametrize("outer", ["tf", "msg"])
def test_gradients_of_checkpointed_gradients(outer):
    """Hessian-vector products: differentiate sum(g * v) where g are checkpointed gradients."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws, hidden, loss = chain(x)
        vector = [tf.ones_like(w) * 0.1 for w in ws]

        def hvp(gradients):
            inner = tf.add_n(
                [tf.reduce_sum(g * v) for g, v in zip(gradients, vector, strict=True)]
            )
            if outer == "tf":
                return tf1.gradients(inner, ws)
            return msg.gradients(inner, ws, checkpoints="memory")

        reference = hvp(tf1.gradients(loss, ws))
        got = hvp(msg.gradients(loss, ws, checkpoints=hidden[1::3]))
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            values = run_with_nones(session, [reference, got], {x: np.ones((4, WIDTH))})
    assert_same_gradients(*values, rtol=1e-4)


def test_patched_tensorflow_calling_tf_gradients_internally_does_not_recurse():
    """tf.hessians calls the gradients function of TensorFlow's module, which is patched."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [WIDTH])
        w = tf.Variable(np.linspace(-1, 1, WIDTH).astype(np.float32))
        h = x
        for _ in range(6):
            h = tf.tanh(h * w + 0.1)
        loss = tf.reduce_sum(h * h)
        reference = tf.hessians(loss, w)
        with msg.patched("memory"):
            got = tf.hessians(loss, w)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            values = session.run([reference, got], {x: np.ones(WIDTH)})
    assert_same_gradients(*values, rtol=1e-4)


def test_patched_gradients_inside_a_tf_function_called_many_times():
    ws, _, _ = chain(tf.ones([4, WIDTH]))

    @tf.function
    def step(x):
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        return tf.gradients(tf.reduce_sum(h * h), ws)

    with msg.patched("memory"):
        first = [g.numpy() for g in step(tf.ones([4, WIDTH]))]
        second = [g.numpy() for g in step(tf.ones([4, WIDTH]))]
        other_shape = [g.numpy() for g in step(tf.ones([2, WIDTH]))]
    assert_same_gradients(first, second)
    assert len(other_shape) == len(ws)


def test_a_graph_is_freed_once_its_gradients_are_built_and_dropped():
    """Nothing the library keeps holds a graph (or the variables a function captured)."""
    import gc
    import weakref

    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws, hidden, loss = chain(x)
        msg.gradients(loss, ws, checkpoints=hidden[2::3])
        msg.gradients(loss, ws, checkpoints="memory")
    freed = weakref.ref(graph)
    del graph, x, ws, hidden, loss
    gc.collect()
    assert freed() is None
