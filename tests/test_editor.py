"""Copying ops."""

import numpy as np
import tensorflow as tf

from memory_saving_gradients._src.rewriting import editor

tf1 = tf.compat.v1


def test_copies_read_copies_inside_the_set_and_originals_outside():
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [3], name="x")
        a = tf.tanh(x, name="a")
        gate = tf.constant(1.0, name="gate")
        with tf1.control_dependencies([a.op, gate.op]):
            b = tf.sin(a, name="b")
        c = tf.multiply(b, a, name="c")
        copies = editor.copy_ops([b.op, c.op], scope="recompute/")
        b_copy, c_copy = copies[b.op], copies[c.op]
        assert [t.name for t in b_copy.inputs] == ["a:0"]
        assert [t.name for t in c_copy.inputs] == ["recompute/b:0", "a:0"]
        assert b_copy.control_inputs == b.op.control_inputs == [gate.op]
        assert c_copy.name == "recompute/c"
        value = np.array([0.1, 0.2, 0.3], np.float32)
        with tf1.Session(graph=graph) as session:
            original, copied = session.run([c, c_copy.outputs[0]], {x: value})
        np.testing.assert_array_equal(original, copied)


def test_control_inputs_map_to_copies_within_the_set():
    with tf.Graph().as_default():
        x = tf.constant([1.0])
        a = tf.tanh(x)
        with tf1.control_dependencies([a.op]):
            b = tf.sin(x)
        copies = editor.copy_ops([a.op, b.op], scope="c/")
        assert copies[b.op].control_inputs == [copies[a.op]]
