"""Wherever tf.gradients answers, the checkpointed gradients give the same answer.

Regression tests for code this project did not write: nested tf.function layers and Defun
compositions (call ops), Keras applications with TensorFlow's graph optimizers on, the corners
of the tf.gradients contract, and patched TensorFlow's callers.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import function
from tensorflow.python.ops import list_ops

import memory_saving_gradients as msg
from memory_saving_gradients._src.models.command import dtype_policy
from tests.helpers import (
    assert_recomputes,
    assert_recomputes_where_it_pays,
    assert_same_gradients,
    recomputed_copies,
    run_with_nones,
    square_weights,
    values,
)

tf1 = tf.compat.v1
STRATEGIES = ["memory", "balanced", "speed"]


def nested_function_chain(depth: int = 12, width: int = 64):
    """The issue's chain: each layer a nested tf.function, so a call op in the outer graph."""
    rng = np.random.default_rng(0)
    ws = [tf.Variable(rng.standard_normal((width, width)).astype("f4") / 8) for _ in range(depth)]
    x = tf.constant(rng.standard_normal((256, width)).astype("f4"))

    @tf.function
    def layer(h, w):
        return tf.tanh(tf.matmul(h, w))

    def loss():
        h = x
        for w in ws:
            h = layer(h, tf.convert_to_tensor(w))
        return tf.reduce_sum(h * h)

    return ws, loss


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nested_tf_function_layers_under_patch(strategy):
    """Each boundary made by a call op used to be crossed twice (2x for 9 of 12 weights);
    'speed' found no matmul in the outer graph and refused."""
    ws, loss = nested_function_chain()
    reference = tf.function(lambda: tf.gradients(loss(), ws))()
    recomputed = []

    def checkpointed():
        y = loss()
        plan = msg.plan(y, ws, checkpoints=strategy)
        grads = tf.gradients(y, ws)
        assert_recomputes_where_it_pays(plan)
        recomputed.append(any("/recompute_" in op.name for op in grads[0].graph.get_operations()))
        return grads

    with msg.patched(strategy):
        got = tf.function(checkpointed)()
    assert recomputed == [strategy != "speed"]  # 'speed' keeps every call's output: plain
    assert_same_gradients(*values([reference, got]))


def test_checkpoint_at_a_defun_call():
    """tf.compat.v1 Defun composition with a checkpoint at a call's output (was 80, not 40)."""

    @function.Defun(tf.float32)
    def square(v):
        return v * v

    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3])
        first = square(x)
        second = square(tf.sin(first))
        y = tf.reduce_sum(square(tf.cos(second)))
        reference = tf1.gradients(y, x)
        got = msg.gradients(y, x, checkpoints=[first, second])
        assert_recomputes(tf1.get_default_graph())
        with tf1.Session() as session:
            want, have = session.run([reference, got], {x: [0.5, 1.0, 2.0]})
    assert_same_gradients(want, have)


def keras_gradients(model, strategy, batch: int = 2):
    """(tf.gradients, checkpointed) of a classification loss, in two separate tf.functions
    (reference gradient ops in the same graph would change what grappler fuses)."""
    shape = (batch, *model.input_shape[1:])
    x = tf.constant(np.random.default_rng(0).random(shape).astype("f4"))
    labels = tf.constant(np.arange(batch) % model.output_shape[-1])

    def run(gradients):
        @tf.function
        def step():
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits))
            return gradients(loss, model.trainable_variables)

        return [g.numpy() for g in step()]

    reference = run(tf.gradients)
    got = run(lambda loss, xs: msg.gradients(loss, xs, checkpoints=strategy))
    return reference, got


def assert_close_to_scale(reference, got, rtol=1e-5):
    """Equal to round-off: each gradient to `rtol` of its own largest entry, or of the largest
    of all where it is (analytically) zero, as a bias before batch normalization is."""
    scale = max(float(np.abs(r).max()) for r in reference)
    assert_same_gradients(reference, got, rtol=rtol, atol=rtol * scale)


@pytest.mark.tf2_only
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_keras_resnet50_with_onednn_fusions(strategy):
    """'speed' made 2673 nodes in a cycle: oneDNN fused a bias gradient the recomputation
    waited for with a filter gradient computed from the recomputation. Batch norm over the
    2x2 maps of a batch of 2 amplifies round-off: under 'memory' the first convolution's
    gradient differs by 1.9e-5 of the largest gradient in float32, and by 2e-14 in float64
    (the float64 case below), so the rewrite computes the same function."""
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    assert_close_to_scale(*keras_gradients(model, strategy), rtol=5e-5)


@pytest.mark.tf2_only
def test_keras_resnet50_equals_tf_gradients_in_float64():
    with dtype_policy("float64"):
        keras.utils.set_random_seed(0)
        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
        assert_close_to_scale(*keras_gradients(model, "memory"), rtol=1e-10)


@pytest.mark.tf2_only
def test_keras_resnet50_under_mixed_bfloat16():
    """Its kernels' bfloat16 copies wait for their convolutions (NOTE [weight ops wait for
    their readers]): waiting for the ops making each convolution's input closed a cycle
    ("6901 nodes in a cycle") where oneDNN folds conv1's Pad into the convolution reading it.
    bfloat16 keeps 8 bits: all gradients but one agree to 0.1% of the largest, and a bias
    before batch normalization, whose gradient is analytically zero, to 0.4% (so with the
    copies left free too)."""
    with dtype_policy("mixed_bfloat16"):
        keras.utils.set_random_seed(0)
        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
        assert_close_to_scale(*keras_gradients(model, "memory"), rtol=1e-2)


def residual_cnn(blocks: int = 4, channels: int = 8) -> keras.Model:
    """Residual blocks whose second convolution keeps its bias (added before the sum)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(channels, 3, padding="same")(inputs)
    for _ in range(blocks):
        r = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(h)
        r = keras.layers.ReLU()(keras.layers.BatchNormalization()(r))
        r = keras.layers.Conv2D(channels, 3, padding="same")(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    outputs = keras.layers.Dense(5)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, outputs)


@pytest.mark.tf2_only
def test_bias_gradients_under_mixed_bfloat16_keep_their_fused_kernel():
    """`tunables.FUSION_SPLIT`: 'memory' used to cut the last block between its convolution
    and the BiasAdd after it. The bias gradient then ran apart from the filter gradient, in
    TensorFlow's bfloat16 CPU kernel, which sums in bfloat16: 0.125 where the fused kernel
    gives 0.361, 65% of the gradient's largest entry off. Now each bias gradient is within
    2.2% of `tf.gradients`' (bfloat16 keeps 8 bits, and its round-off reaches 11% of a
    kernel's gradient here between TensorFlow's own graphs with and without grappler's
    fusions)."""
    with dtype_policy("mixed_bfloat16"):
        model = residual_cnn()
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((16, 12, 12, 3)).astype("f4"))
        labels = tf.constant(rng.integers(0, 5, 16))
        loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def run(gradients):
            step = tf.function(lambda: gradients(loss_of(labels, model(x, training=True))))
            return [g.numpy().astype("f4") for g in step()]

        reference = run(lambda loss: tf.gradients(loss, model.trainable_variables))
        got = run(
            lambda loss: msg.gradients(loss, model.trainable_variables, checkpoints="memory")
        )
    for variable, want, have in zip(model.trainable_variables, reference, got, strict=True):
        if "bias" in variable.path:
            scale = float(np.abs(want).max())
            assert float(np.abs(want - have).max()) <= 0.05 * scale, variable.path


@pytest.mark.tf2_only
def test_keras_convnext_with_function_call_layers():
    """ConvNeXt's layers include call ops; 'memory' crashed in their SymbolicGradient."""
    keras.utils.set_random_seed(0)
    model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3), classes=10)
    assert_close_to_scale(*keras_gradients(model, "memory"))


@pytest.mark.tf2_only
def test_keras_mobilenet_v3_equals_tf_gradients_in_float64():
    """Hard-swish, squeeze-and-excitation gates, and batch-norm biases whose gradients are
    analytically zero. In float32 the two differ by up to 6e-5 of the largest gradient (batch
    norm over 2x2 maps of batch 2 amplifies round-off, and recomputed ops fuse differently);
    in float64 by 1e-13, so the rewrite computes the same function."""
    with dtype_policy("float64"):
        keras.utils.set_random_seed(0)
        model = keras.applications.MobileNetV3Small(
            weights=None, input_shape=(64, 64, 3), classes=10, dropout_rate=0.0
        )
        reference, got = keras_gradients(model, "memory")
    assert all(r.dtype == np.float64 for r in reference)
    assert_close_to_scale(reference, got, rtol=1e-10)


def recurrent_model():
    """Keras's recurrent layers, each a while loop whose gradient is another, between convolutions
    and dense layers applied to every step of the sequence (what is recomputed)."""
    layers = keras.layers
    keras.utils.set_random_seed(0)
    inputs = keras.Input((24, 8))
    h = layers.Conv1D(32, 3, padding="same", activation="relu")(inputs)
    h = layers.LSTM(32, return_sequences=True)(h)
    h = layers.Dense(64, activation="gelu")(h)
    h = layers.Bidirectional(layers.GRU(16, return_sequences=True))(h)
    h = layers.Dense(64, activation="tanh")(h)
    h = layers.SimpleRNN(16)(h)
    return keras.Model(inputs, layers.Dense(5)(h))


@pytest.mark.tf2_only
@pytest.mark.parametrize("strategy", [*STRATEGIES, msg.MemoryBudget(0.5)], ids=str)
def test_keras_recurrent_layers_equal_tf_gradients(strategy):
    model = recurrent_model()
    x = tf.constant(np.random.default_rng(0).random((16, 24, 8)).astype("f4"))

    @tf.function
    def step(checkpoints):
        loss = tf.reduce_sum(model(x, training=True) ** 2)
        if checkpoints is None:
            return tf.gradients(loss, model.trainable_variables)
        gradients = msg.gradients(loss, model.trainable_variables, checkpoints=checkpoints)
        assert_recomputes(tf1.get_default_graph())
        return gradients

    reference = [g.numpy() for g in step(None)]
    assert_close_to_scale(reference, [g.numpy() for g in step(strategy)])


def chain(n: int = 6, width: int = 8):
    x = tf1.placeholder(tf.float32, [4, width], name="x")
    ws = [tf.Variable(np.eye(width, dtype=np.float32) * 0.9, name=f"w{i}") for i in range(n)]
    h, hidden = x, []
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
        hidden.append(h)
    return x, ws, hidden


def evaluate(fetches, x):
    with tf1.Session() as session:
        session.run(tf1.global_variables_initializer())
        return run_with_nones(session, fetches, {x: np.ones(x.shape, np.float32)})


def test_indexed_slices_grad_ys_stay_sparse_like_tf_gradients():
    with tf.Graph().as_default():
        x, ws, hidden = chain()
        table = tf.Variable(np.ones((5, 8), np.float32))
        rows = tf.gather(table, [1, 3]) * tf.reduce_mean(hidden[-1])
        sparse = tf.IndexedSlices(tf.ones([1, 8]), tf.constant([1]))
        reference = tf1.gradients(rows, rows, grad_ys=[sparse])
        got = msg.gradients(rows, rows, grad_ys=[sparse], checkpoints="memory")
        assert isinstance(reference[0], tf.IndexedSlices) and isinstance(got[0], tf.IndexedSlices)
        assert_same_gradients(*evaluate([[reference[0].values], [got[0].values]], x))
        seed = tf.IndexedSlices(tf.ones([1, 8]), tf.constant([1]), tf.constant([2, 8]))
        reference = tf1.gradients(rows, [rows, table, *ws], grad_ys=[seed])
        got = msg.gradients(rows, [rows, table, *ws], grad_ys=[seed], checkpoints="memory")
        assert_recomputes(tf1.get_default_graph())
        assert [type(g) for g in got] == [type(g) for g in reference]
        assert_same_gradients(*evaluate([reference, got], x))


@pytest.mark.parametrize("dtype", [tf.int32, tf.bool])
def test_integer_and_boolean_ys_give_none_like_tf_gradients(dtype):
    with tf.Graph().as_default():
        x, ws, hidden = chain()
        counted = tf.cast(hidden[-1] > 0, dtype)
        assert tf1.gradients(counted, ws) == [None] * len(ws)
        assert msg.gradients(counted, ws, checkpoints="memory") == [None] * len(ws)
        zeros = msg.gradients(counted, ws, checkpoints="memory", unconnected_gradients="zero")
        assert all(z is not None for z in zeros)
        loss = tf.reduce_sum(hidden[-1])
        reference = tf1.gradients([counted, loss], ws)
        got = msg.gradients([counted, loss], ws, checkpoints="memory")
        assert_recomputes(tf1.get_default_graph())
        assert_same_gradients(*evaluate([reference, got], x))


def test_variant_ys_with_variant_grad_ys():
    with tf.Graph().as_default():
        x, ws, hidden = chain()
        listed = list_ops.tensor_list_from_tensor(hidden[-1], element_shape=[8])
        seed = list_ops.tensor_list_from_tensor(tf.ones([4, 8]), element_shape=[8])
        reference = tf1.gradients(listed, ws, grad_ys=[seed])
        got = msg.gradients(listed, ws, grad_ys=[seed], checkpoints="memory")
        assert_same_gradients(*evaluate([reference, got], x))


def test_ys_captured_from_an_enclosing_graph():
    def outer(gradients):
        @tf.function
        def run(v):
            y = tf.tanh(tf.tanh(v * 4.0))

            @tf.function
            def inner(w):
                return [g for g in gradients(y, [v, w]) if g is not None]

            return inner(v)

        return values(run(tf.constant([0.1, 0.2])))

    want = outer(tf.gradients)
    have = outer(lambda ys, xs: msg.gradients(ys, xs, checkpoints="memory"))
    assert len(want) == len(have) == 1
    assert_same_gradients(want, have)


@pytest.mark.parametrize("strategy", ["memory", "balanced"])
def test_ys_and_xs_from_two_enclosing_graphs(strategy):
    """TensorFlow's `testCapturedNested`: ys read values captured from both graphs enclosing
    a nested function, one y is itself an x of the outermost graph, and xs live there. TF
    gives 4.0 and 2.0; a ValueError was raised."""

    def run(gradients):
        with tf.Graph().as_default():
            a = tf.constant(1.0, name="a")
            b = tf.constant(2.0, name="b")
            product = a * b

            @tf.function
            def outer():
                seen_outside = tf.identity(a)

                @tf.function
                def inner():
                    ys = [tf.identity(seen_outside), tf.identity(b), tf.identity(product), a]
                    return gradients(ys, [a, b])

                return inner()

            return values(outer())

    want = run(tf.gradients)
    have = run(lambda ys, xs: msg.gradients(ys, xs, checkpoints=strategy))
    assert [float(v) for v in want] == [float(v) for v in have] == [4.0, 2.0]


def test_variables_of_an_enclosing_graph_are_checkpointed_through_their_captures():
    """A TF1 program's variables live in the default graph and a tf.function reads them
    through captures: xs of an enclosing graph. Their gradients were TensorFlow's own, nothing
    recomputed; now the body is checkpointed with the captures among its xs."""
    with tf.Graph().as_default() as graph:
        ws = square_weights(12, 64)
        traced = {}

        @tf.function
        def step(x):
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(tf.square(h))
            traced["plan"] = msg.plan(loss, ws, checkpoints="memory")
            got = msg.gradients(loss, ws, checkpoints="memory")
            traced["recomputed"] = len(recomputed_copies(tf1.get_default_graph()))
            return tf.gradients(loss, ws), got

        reference, got = step(tf.constant(np.ones([256, 64], np.float32)))
        assert all(w.handle.graph is graph for w in ws)
        assert traced["plan"].pays and traced["recomputed"] > 0
        assert_same_gradients(*values([reference, got]))


def test_invalid_unconnected_gradients_fails_first_with_tensorflows_message():
    with tf.Graph().as_default() as graph:
        _, ws, hidden = chain()
        loss = tf.reduce_sum(hidden[-1])
        before = len(graph.get_operations())
        with pytest.raises(ValueError, match="Unknown value for unconnected_gradients: 'bogus'"):
            msg.gradients(loss, ws, checkpoints="memory", unconnected_gradients="bogus")
        assert len(graph.get_operations()) == before


@pytest.mark.parametrize("strategy", ["speed", "collection"])
def test_patched_tensorflow_never_refuses(strategy, caplog):
    """'speed' without matmuls and an empty collection: TensorFlow's own gradients, logged."""
    caplog.set_level(logging.INFO, logger="memory_saving_gradients")
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3])
        y = tf.reduce_sum(tf.tanh(tf.sin(x)) * x)
        reference = tf1.gradients(y, x)
        with msg.patched(strategy):
            got = tf.gradients(y, x)
            hessian = tf.hessians(y, x)
        with pytest.raises(msg.NoCheckpointsError):
            msg.gradients(y, x, checkpoints=strategy)
        with tf1.Session() as session:
            want, have, second = session.run([reference, got, hessian], {x: [0.1, 0.2, 0.3]})
    assert_same_gradients(want, have)
    assert second[0].shape == (3, 3)
    assert "Computing TensorFlow's own gradients" in caplog.text


def tanh_chain(depth: int = 6, width: int = 16):
    rng = np.random.default_rng(3)
    ws = [
        tf.Variable(rng.standard_normal((width, width)).astype("f4") * 0.3) for _ in range(depth)
    ]
    x = tf.constant(rng.standard_normal((4, width)).astype("f4"))

    def loss(h=x):
        for w in ws:
            h = tf.tanh(h @ w)
        return tf.reduce_sum(h * h)

    return ws, x, loss


def test_gradients_an_outer_tape_differentiates_are_tensorflows(caplog):
    """A tape records ops as their Python wrappers make them, never the recomputed copies: its
    gradients of checkpointed gradients missed every path through them (3 of 6 weights'
    second derivatives wrong). Under a recording tape TensorFlow's own gradients are
    computed, and a warning says why."""
    ws, _, loss = tanh_chain()

    @tf.function
    def second_order(gradients):
        with tf.GradientTape() as outer:
            g = gradients(loss(), ws[0])[0]
            norm = tf.reduce_sum(g * g)
        return outer.gradient(norm, ws)

    reference = second_order(tf.gradients)
    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        got = second_order(lambda y, x: msg.gradients(y, x, checkpoints="memory"))
    assert_same_gradients(*values([reference, got]))
    assert "GradientTape or ForwardAccumulator is recording" in caplog.text


def test_hessian_vector_products_by_forward_over_reverse():
    """tf.autodiff.ForwardAccumulator around the gradients (forward-over-reverse, the usual
    Hessian-vector product): a JVP through checkpointed gradients was silently wrong (9.8 off
    in 20); TensorFlow's own gradients are computed there. Outside the accumulator the same
    call still recomputes."""
    ws, _, loss = tanh_chain()

    copies = []  # recomputed ops after the call under the accumulator, and after one outside

    @tf.function
    def hessian_vector_product(gradients):
        with tf.autodiff.ForwardAccumulator(ws[0], tf.ones_like(ws[0])) as accumulator:
            g = gradients(loss(), ws[0])[0]
        copies.append(len(recomputed_copies(tf1.get_default_graph())))
        gradients(loss(), ws[0])
        copies.append(len(recomputed_copies(tf1.get_default_graph())))
        return accumulator.jvp(g)

    reference = hessian_vector_product(tf.gradients)
    copies.clear()
    got = hessian_vector_product(lambda y, x: msg.gradients(y, x, checkpoints="memory"))
    assert_same_gradients(*values([[reference], [got]]))
    assert copies[0] == 0 and copies[1] > 0, copies


def test_per_example_gradients_under_vectorized_map():
    """tf.vectorized_map over a gradient call (per-example gradients, as DP-SGD takes them)
    vectorizes every op the rewrite makes; a gate's Fill had int64 dims, which its
    vectorization cannot prepend the int32 batch to (a TypeError)."""
    ws, x, loss = tanh_chain()

    copies = []

    @tf.function
    def per_example(gradients):
        grads = tf.vectorized_map(lambda row: gradients(loss(row[None]), ws), x)
        copies.append(len(recomputed_copies(tf1.get_default_graph())))
        return grads

    reference = per_example(tf.gradients)
    got = per_example(lambda y, xs: msg.gradients(y, xs, checkpoints="memory"))
    assert copies[-1] > 0
    assert_same_gradients(*values([reference, got]))
