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
WIDTH, BATCH = 8, 64

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
    """A batch of 64 rows, so that activations, not the weights' conjugates in complex
    gradients, make the peak: checkpointing pays, and the rewrite is what is compared."""
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(dtype, [BATCH, WIDTH])
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
            value = session.run(initial([BATCH, WIDTH], dtype, 99))
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


@pytest.mark.parametrize("checkpoints", ["speed", "list"])
def test_a_gradient_nothing_is_recomputed_for_is_tensorflows_own(checkpoints):
    """TensorFlow's `testColocateGradients`: keeping `wx = w @ x`, which is also the y,
    leaves nothing to recompute, so the gradient is TensorFlow's own MatMul, colocated with
    `wx`'s op (it was an Identity of ours, colocated with nothing)."""
    with tf.Graph().as_default() as graph:
        w = tf.constant(1.0, shape=[1, 1])
        x = tf.constant(1.0, shape=[1, 2])
        with graph.device("/device:GPU:0"):
            wx = tf.matmul(w, x)
        chosen = [wx] if checkpoints == "list" else checkpoints
        gw = msg.gradients(wx, [w], checkpoints=chosen, colocate_gradients_with_ops=True)[0]
    assert gw.op.type == "MatMul"
    assert gw.op.colocation_groups() == wx.op.colocation_groups()
    assert gw.device == "/device:GPU:0"


def test_returned_gradients_are_placed_and_colocated_like_tensorflows():
    """Where segments are recomputed, each gradient is passed on by an identity once every
    reader of its variable has run (NOTE [updates after reads]); the identity, the gates and
    the sums of gradient parts keep the device and colocation of what they pass on."""
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [64, WIDTH])
        ws = []
        for i in range(8):
            with graph.device(f"/device:GPU:{i % 2}"):
                ws.append(tf.Variable(initial([WIDTH, WIDTH], tf.float32, i)))
        h = x
        for i, w in enumerate(ws):
            with graph.device(f"/task:{i % 3}"):
                h = tf.tanh(tf.matmul(h, w) + tf.matmul(h, w * 0.5))
        loss = tf.reduce_sum(h * h)
        options = {"colocate_gradients_with_ops": True}
        reference = tf1.gradients(loss, ws, **options)
        got = msg.gradients(loss, ws, checkpoints="memory", **options)
        assert recomputed_copies(graph)
        for want, have in zip(reference, got, strict=True):
            assert have.op.type == "Identity"
            assert have.device == want.device
            assert have.op.colocation_groups() == want.op.colocation_groups()
        gates = [
            op
            for op in graph.get_operations()
            if op.type == "Slice" and op.inputs[1].op.type == "Fill"
        ]
        assert gates
        for gate in gates:
            source = gate.inputs[0].op
            assert (gate.device, gate.colocation_groups()) == (
                source.device,
                source.colocation_groups(),
            ), gate.name
