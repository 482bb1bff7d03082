"""Every float and complex dtype TensorFlow differentiates; device and colocation placement."""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.helpers import (
    assert_recomputes,
    assert_same_gradients,
    original_of,
    recomputed_copies,
    run_with_nones,
)

tf1 = tf.compat.v1
WIDTH = 8

#: dtype -> relative tolerance: recomputation repeats the same ops, so only summation order
#: differs, which low precision types round more coarsely.
DTYPES = {
    tf.float16: 2e-2,
    tf.bfloat16: 5e-2,
    tf.float32: 1e-5,
    tf.float64: 1e-10,
    tf.complex64: 1e-5,
}


def initial(shape, dtype, seed):
    rng = np.random.RandomState(seed)
    value = rng.randn(*shape) / np.sqrt(shape[0])
    if dtype.is_complex:
        value = value + 1j * rng.randn(*shape) / np.sqrt(shape[0])
    return tf.cast(tf.constant(value), dtype)


@pytest.mark.parametrize("strategy", ["memory", "list"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: d.name)
def test_dtypes(dtype, strategy):
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(dtype, [4, WIDTH])
        ws = [tf.Variable(initial([WIDTH, WIDTH], dtype, i), name=f"w{i}") for i in range(8)]
        h, hidden = x, []
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
            hidden.append(h)
        # A real loss: for complex h, |h|^2.
        loss = tf.reduce_sum(tf.math.real(h * tf.math.conj(h)) if dtype.is_complex else h * h)
        reference = tf1.gradients(loss, ws)
        got = msg.gradients(loss, ws, checkpoints=hidden[1::3] if strategy == "list" else "memory")
        assert_recomputes(graph)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            value = session.run(initial([4, WIDTH], dtype, 99))
            values = run_with_nones(session, [reference, got], {x: value})
    to_wide = (
        (lambda v: v.astype(np.complex128))
        if dtype.is_complex
        else (lambda v: v.astype(np.float64))
    )
    assert_same_gradients(
        [to_wide(v) for v in values[0]], [to_wide(v) for v in values[1]], rtol=DTYPES[dtype]
    )


def test_recomputed_ops_keep_their_device_on_several_devices():
    config = tf1.ConfigProto(device_count={"CPU": 2}, allow_soft_placement=False)
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws = [tf.Variable(initial([WIDTH, WIDTH], tf.float32, i)) for i in range(8)]
        h = x
        for i, w in enumerate(ws):
            with tf.device(f"/cpu:{i // 4}"):
                h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        reference = tf1.gradients(loss, ws)
        got = msg.gradients(loss, ws, checkpoints="memory")
        copies = recomputed_copies(graph)
        assert copies
        for copy in copies:
            original = original_of(copy)
            assert copy.device == original.device, copy.name
        assert {copy.device for copy in copies} >= {"/device:CPU:0", "/device:CPU:1"}
        with tf1.Session(config=config) as session:
            session.run(tf1.global_variables_initializer())
            values = run_with_nones(session, [reference, got], {x: np.ones((4, WIDTH))})
    assert_same_gradients(*values)


def test_colocation_constraints_are_kept():
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws = [tf.Variable(initial([WIDTH, WIDTH], tf.float32, i)) for i in range(6)]
        h = x
        for w in ws:
            with tf1.colocate_with(w.handle.op):
                h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        msg.gradients(loss, ws, checkpoints="memory")
        copies = recomputed_copies(graph)
        assert copies
        for copy in copies:
            original = original_of(copy)
            assert copy.colocation_groups() == original.colocation_groups(), copy.name
            assert original.colocation_groups()[0].startswith(b"loc:@Variable")
