"""Checkpointed gradients equal tf.gradients on every supported model and strategy."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import graphs as models
from tests.helpers import (
    assert_recomputes,
    assert_same_gradients,
    gradients_in_function,
    gradients_in_session,
    recomputed_copies,
)

tf1 = tf.compat.v1
STRATEGIES = ["memory", "balanced", "speed", "collection", "list"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", sorted(models.ALL))
def test_session_gradients_equal_tf_gradients(model_name, strategy):
    reference, got = gradients_in_session(models.ALL[model_name], strategy)
    assert_same_gradients(reference, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", sorted(models.ALL))
def test_function_gradients_equal_tf_gradients(model_name, strategy):
    reference, got = gradients_in_function(models.ALL[model_name], strategy)
    assert_same_gradients(reference, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_with_respect_to_the_input_too(strategy):
    reference, got = gradients_in_session(models.residual_chain, strategy, input_gradient=True)
    assert_same_gradients(reference, got)
    reference, got = gradients_in_function(models.tanh_chain, strategy, input_gradient=True)
    assert_same_gradients(reference, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_ys_are_backpropagated(strategy):
    seeds = [
        lambda y: np.float32(0.5),
        lambda y: np.float32(-2.0),
        lambda y: np.linspace(-1, 1, int(np.prod(y.shape))).astype(np.float32).reshape(y.shape),
    ]
    reference, got = gradients_in_session(models.several_ys, strategy, grad_ys=seeds)
    assert_same_gradients(reference, got)


def test_embedding_gradient_stays_sparse():
    reference, got = gradients_in_session(models.embedding_model, "memory")
    assert type(got[0]).__name__ == type(reference[0]).__name__ == "IndexedSlicesValue"


@pytest.mark.tf2_only
def test_convolution_checkpoints_in_a_residual_network():
    """With the convolutions as checkpoints, a convolution's bias gradient comes from the
    segment after its filter gradient, both computed from the same incoming gradient, and
    grappler's oneDNN remapper fuses the two: a wait between segments that depended on the
    bias gradient made the step a cycle ("nodes in a cycle")."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    h = inputs
    for _ in range(3):
        r = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(h)
        r = keras.layers.ReLU()(keras.layers.BatchNormalization()(r))
        h = keras.layers.ReLU()(h + keras.layers.Conv2D(4, 3, padding="same")(r))
    model = keras.Model(inputs, h)
    x = tf.constant(np.random.default_rng(0).standard_normal((2, 8, 8, 4)).astype("f4"))

    def step(gradients, **options):
        @tf.function
        def run(x):
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
            grads = gradients(loss, [v.value for v in model.trainable_variables], **options)
            if options:
                assert_recomputes(tf.compat.v1.get_default_graph())
            return grads

        return [g.numpy() for g in run(x)]

    # Separate functions: reference gradient ops in the same graph would keep grappler from
    # fusing the checkpointed ones.
    reference = step(tf.gradients)
    got = step(msg.gradients, checkpoints="speed")
    assert_same_gradients(reference, got)


def residual_conv_net(blocks: int = 4):
    """conv, batch-statistics normalisation, ReLU, conv, add, ReLU: the skip path has no conv."""
    x = tf1.placeholder(tf.float32, [2, 8, 8, 4])
    h = x
    for i in range(blocks):
        r = tf.nn.conv2d(h, tf.Variable(tf.random.normal([3, 3, 4, 4], seed=i)), 1, "SAME")
        mean, variance = tf.nn.moments(r, [0, 1, 2])
        r = tf.nn.relu(tf.nn.batch_normalization(r, mean, variance, None, None, 1e-3))
        r = tf.nn.conv2d(r, tf.Variable(tf.random.normal([3, 3, 4, 4], seed=i + 9)), 1, "SAME")
        h = tf.nn.relu(h + r, name=f"block{i}")
    return x, tf.reduce_sum(tf.square(h))


def recomputed_originals(graph: tf.Graph) -> list[str]:
    """The name of the original of every recomputed copy (scope and recompute level dropped)."""
    return [op.name.split("/recompute_")[1].split("/", 1)[1] for op in recomputed_copies(graph)]


def residual_conv_net_recomputation(checkpoints) -> list[str]:
    """Check the checkpointed gradients of `residual_conv_net` against tf.gradients; return
    the originals of the recomputed ops. `checkpoints` may be a function of the graph."""
    with tf.Graph().as_default() as graph:
        x, loss = residual_conv_net()
        weights = tf1.trainable_variables()
        chosen = checkpoints(graph) if callable(checkpoints) else checkpoints
        got = msg.gradients(loss, weights, checkpoints=chosen)
        reference = tf1.gradients(loss, weights)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            feed = {x: np.random.default_rng(0).standard_normal((2, 8, 8, 4))}
            assert_same_gradients(*session.run([reference, got], feed))
        return recomputed_originals(graph)


def test_speed_recomputes_each_op_once_on_a_residual_network(caplog):
    """'speed' keeps the skip path where it leaves the convolutions' segments."""
    caplog.set_level(logging.WARNING, logger="memory_saving_gradients")
    recomputed = residual_conv_net_recomputation("speed")
    assert "recomputed in several segments" not in caplog.text
    assert recomputed and len(recomputed) == len(set(recomputed))


def test_checkpoints_leaving_a_path_uncut_are_reported(caplog):
    """Kept only at its convolutions, the skip path is recomputed behind every one of them."""

    def convolutions(graph):
        return [op.outputs[0] for op in graph.get_operations() if op.type == "Conv2D"]

    caplog.set_level(logging.WARNING, logger="memory_saving_gradients")
    recomputed = residual_conv_net_recomputation(convolutions)
    assert "4 ops are recomputed in several segments, e.g. ['add', 'add_1', 'block0']" in (
        caplog.text
    )
    assert len(recomputed) > len(set(recomputed))


@pytest.mark.tf2_only
@pytest.mark.parametrize("strategy", ["memory", "speed"])
def test_keras_variables_as_xs(strategy):
    """Keras 3 variables are no tf.Variable; like tf.gradients, differentiate their handles
    (reading them again would give a tensor the loss does not depend on, and None)."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(16, activation="gelu") for _ in range(6)]  # 'speed' pays
    model = keras.Sequential([keras.Input((16,)), *layers])
    variables = model.trainable_variables
    assert not isinstance(variables[0], tf.Variable)

    @tf.function
    def run(x):
        loss = tf.reduce_sum(tf.square(model(x)))
        got = msg.gradients(loss, variables, checkpoints=strategy)
        assert_recomputes(tf.compat.v1.get_default_graph())
        return tf.gradients(loss, variables), got

    reference, got = run(tf.ones((256, 16)))
    assert_same_gradients([g.numpy() for g in reference], [g.numpy() for g in got])


@pytest.mark.parametrize("model_name", ["tanh_chain", "residual_chain", "conv_batchnorm_relu"])
def test_nested_recomputation_gives_tf_gradients(model_name):
    """A budget below what one level of cuts reaches checkpoints inside segments too (batches
    large enough that activations, not weight gradients, make the peak)."""
    model_fn = {
        "tanh_chain": lambda: models.tanh_chain(depth=30, batch=256),
        "residual_chain": lambda: models.residual_chain(depth=30, batch=256),
        "conv_batchnorm_relu": lambda: models.conv_batchnorm_relu(blocks=8),
    }[model_name]
    with tf.Graph().as_default():
        model = model_fn()
        x = tf1.placeholder(model.x.dtype, model.x.shape)
        ys, _ = model.forward(x)
        plan = msg.plan(ys, model.variables, checkpoints=msg.MemoryBudget(0.05))
        assert plan.nested, plan
        reference = tf1.gradients(ys, model.variables)
        got = msg.gradients(ys, model.variables, checkpoints=plan)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            want, have = session.run([reference, got], {x: model.x})
    assert_same_gradients(want, have)


def _scales_of_softmax(graph: tf.Graph, fetches) -> list[str]:
    """The products of a softmax with a constant that grappler left in `graph` for a run of
    `fetches`."""
    metadata = tf1.RunMetadata()
    with tf1.Session(graph=graph) as session:
        session.run(tf1.global_variables_initializer())
        options = tf1.RunOptions(output_partition_graphs=True)
        session.run(fetches, options=options, run_metadata=metadata)
    nodes = {node.name: node for graph in metadata.partition_graphs for node in graph.node}
    kinds = [
        [nodes[name.split(":")[0]].op for name in node.input if not name.startswith("^")]
        for node in nodes.values()
        if node.op == "Mul"
    ]
    return [
        f"{a} * {b}"
        for a, b in kinds
        if {a.removeprefix("_Mkl"), b} == {"Softmax", "Const"}  # oneDNN's softmax is _MklSoftmax
    ]


def test_a_recomputed_scaled_softmax_is_differentiated_as_tf_gradients_has_it():
    """NOTE [names of recomputed ops]: grappler pairs the scale of a scaled softmax's gradient
    with the incoming gradient, as under tf.gradients, not with the recomputed softmax (which
    would run as soon as the softmax is recomputed and hold its product until the gradient
    arrives)."""
    with tf.Graph().as_default() as graph:
        rng = np.random.default_rng(0)
        h = tf.Variable(rng.standard_normal((2, 32, 8)).astype(np.float32)).read_value()
        x = h
        kept = []
        for _ in range(3):
            with tf.name_scope("scaled_attention"):
                scores = tf.matmul(h, h, transpose_b=True) * 0.25
                h = tf.tanh(tf.matmul(tf.nn.softmax(scores), h))
                kept.append(h)
        loss = tf.reduce_sum(h)
        reference = tf1.gradients(loss, [x])
        got = msg.gradients(loss, [x], checkpoints=kept[:1])
        recomputed = [op for op in recomputed_copies(graph) if op.type == "Softmax"]
    assert recomputed
    assert _scales_of_softmax(graph, reference) == []
    assert _scales_of_softmax(graph, got) == []
