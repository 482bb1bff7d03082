"""`memory_saving_gradients.GradientTape` gives what `tf.GradientTape` gives, recomputing.

Each comparison records one forward pass on both tapes at once (so dropout masks are the same
for both), then asks each for its gradients; every comparison also checks that the
checkpointed tape copied forward ops, so it never compares TensorFlow with itself.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.integrations import tape as tape_module
from tests.helpers import (
    assert_recomputes,
    assert_recomputes_where_it_pays,
    assert_same_gradients,
)

tf1 = tf.compat.v1


def residual_cnn(blocks: int = 4, channels: int = 8) -> keras.Model:
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(channels, 3, padding="same")(inputs)
    for _ in range(blocks):
        r = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.ReLU()(r)
        r = keras.layers.Conv2D(channels, 3, padding="same")(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    outputs = keras.layers.Dense(5)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, outputs)


def attention_model(blocks: int = 2, width: int = 16) -> keras.Model:
    inputs = keras.Input((10, width))
    h = inputs
    for _ in range(blocks):
        attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
        h = keras.layers.LayerNormalization()(h + attended)
        feed = keras.layers.Dense(width)(keras.layers.Dense(2 * width, activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h + feed)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def dropout_model(depth: int = 5, width: int = 32) -> keras.Model:
    layers = [keras.Input((width,))]
    for _ in range(depth):
        layers += [keras.layers.Dense(width, activation="tanh"), keras.layers.Dropout(0.5)]
    return keras.Sequential([*layers, keras.layers.Dense(1)])


MODELS = {
    "residual_cnn": (residual_cnn, (4, 12, 12, 3)),
    "attention": (attention_model, (2, 10, 16)),
    "dropout": (dropout_model, (8, 32)),
}


def model_gradients(name: str, checkpoints):
    """(tf.GradientTape, msg.GradientTape) gradients of one training-mode forward pass, with
    respect to {"weights": trainable variables, "input": x}."""
    build, shape = MODELS[name]
    keras.utils.set_random_seed(0)
    model = build()
    x = tf.constant(np.random.default_rng(1).standard_normal(shape).astype("f4"))

    @tf.function
    def step(x):
        with (
            tf.GradientTape() as reference,
            msg.GradientTape(checkpoints=checkpoints) as tape,
        ):
            reference.watch(x)
            tape.watch(x)
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        sources = {"weights": model.trainable_variables, "input": x}
        plan = msg.plan(loss, tf.nest.flatten(sources), checkpoints=checkpoints)
        got = tape.gradient(loss, sources)
        assert_recomputes_where_it_pays(plan)
        return reference.gradient(loss, sources), got

    return step(x)


@pytest.mark.parametrize("checkpoints", ["memory", "speed", msg.MemoryBudget(0.5)], ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_gradients_equal_tf_gradient_tape(name, checkpoints):
    reference, got = model_gradients(name, checkpoints)
    assert tf.nest.map_structure(lambda t: t is None, reference) == tf.nest.map_structure(
        lambda t: t is None, got
    )
    # Some gradients are zero but for round-off (attention key biases: softmax ignores a shift
    # of the keys), so the tolerance is float32 round-off of the largest gradient.
    scale = max(float(np.abs(g).max()) for g in tf.nest.flatten(reference))
    for want, have in zip(tf.nest.flatten(reference), tf.nest.flatten(got), strict=True):
        np.testing.assert_allclose(have.numpy(), want.numpy(), rtol=1e-5, atol=1e-6 * scale)


def test_dropout_masks_are_the_forward_passes():
    """The dropout gradients above are those of the masks used in the forward pass: with
    another mask (another forward pass) they differ."""
    keras.utils.set_random_seed(0)
    model = dropout_model()
    x = tf.constant(np.random.default_rng(1).standard_normal((8, 32)).astype("f4"))

    @tf.function
    def step(x):
        with msg.GradientTape(checkpoints="speed") as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        with tf.GradientTape() as other_pass:
            other_loss = tf.reduce_mean(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables), other_pass.gradient(
            other_loss, model.trainable_variables
        )

    got, other = step(x)
    assert not np.allclose(got[0].numpy(), other[0].numpy())


def chain(depth: int = 6, width: int = 8):
    rng = np.random.default_rng(0)
    weights = [
        tf.Variable(rng.standard_normal((width, width)).astype("f4") * 0.5, name=f"w{i}")
        for i in range(depth)
    ]
    x = tf.constant(rng.standard_normal((4, width)).astype("f4"))
    return weights, x


def forward(weights, h):
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    return h


def both_tapes(body):
    """Run `body(tape_class, **kwargs)` in one tf.function with each tape class; return both
    results as numpy (None stays None) and whether the checkpointed run recomputed."""

    @tf.function
    def step():
        reference = body(tf.GradientTape)
        got = body(lambda **kw: msg.GradientTape(checkpoints="memory", **kw))
        recomputed = any(
            "/recompute_" in op.name for op in tf1.get_default_graph().get_operations()
        )
        return reference, got, recomputed

    reference, got, recomputed = step()
    as_numpy = lambda t: None if t is None else t.numpy()  # noqa: E731
    return (
        tf.nest.map_structure(as_numpy, reference),
        tf.nest.map_structure(as_numpy, got),
        bool(recomputed),
    )


def assert_same_structures(reference, got):
    assert tf.nest.map_structure(lambda t: t is None, reference) == tf.nest.map_structure(
        lambda t: t is None, got
    )
    assert_same_gradients(tf.nest.flatten(reference), tf.nest.flatten(got))


def test_nested_sources_come_back_in_their_structure():
    weights, x = chain()

    def body(tape_class):
        with tape_class() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(forward(weights, x))
        sources = {"first": weights[:2], "rest": (weights[2:], {"x": x}), "again": weights[0]}
        return tape.gradient(loss, sources)

    reference, got, recomputed = both_tapes(body)
    assert recomputed
    assert set(got) == {"first", "rest", "again"}
    assert isinstance(got["rest"], tuple) and isinstance(got["rest"][1], dict)
    assert_same_structures(reference, got)


def test_output_gradients_weight_each_target():
    weights, x = chain()
    rng = np.random.default_rng(2)
    seed_h = tf.constant(rng.standard_normal((4, 8)).astype("f4"))

    def body(tape_class):
        with tape_class() as tape:
            h = forward(weights, x)
            targets = [h, tf.reduce_sum(tf.sin(h))]
        return tape.gradient(targets, weights, output_gradients=[seed_h, tf.constant(-3.0)])

    reference, got, recomputed = both_tapes(body)
    assert recomputed
    assert_same_structures(reference, got)


def test_unwatched_and_unrecorded_sources_get_none_or_zeros():
    weights, x = chain()
    frozen = tf.Variable(0.7, trainable=False)
    outside = tf.Variable(1.3)

    def body(tape_class):
        read_before = outside.read_value()
        with tape_class() as tape:
            h = forward(weights, x) * frozen * read_before
            with tape.stop_recording():
                paused = tf.reduce_sum(h) * 5.0
            loss = tf.reduce_sum(h * h) + paused
        return tape.gradient(loss, [weights, x, frozen, outside, read_before, tf.constant(1.0)])

    reference, got, recomputed = both_tapes(body)
    assert recomputed
    assert [g is None for g in got[1:]] == [True] * 5
    assert_same_structures(reference, got)

    def zeros_body(tape_class):
        with tape_class() as tape:
            loss = tf.reduce_sum(forward(weights, x) * frozen)
        return tape.gradient(loss, [weights[0], frozen, x], unconnected_gradients="zero")

    reference, got, _ = both_tapes(zeros_body)
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_array_equal(got[2], np.zeros((4, 8)))
    assert_same_structures(reference, got)


def test_explicit_watch_and_watch_accessed_variables_false():
    weights, x = chain()
    frozen = tf.Variable(0.7, trainable=False)

    def body(tape_class):
        with tape_class(watch_accessed_variables=False) as tape:
            tape.watch([weights[2], frozen])
            loss = tf.reduce_sum(forward(weights, x) * frozen)
        return tape.gradient(loss, [*weights, frozen])

    reference, got, recomputed = both_tapes(body)
    assert recomputed
    assert [g is None for g in got] == [True, True, False, True, True, True, False]
    assert_same_structures(reference, got)


def test_gradient_with_respect_to_an_intermediate_and_a_target_outside_the_tape():
    weights, x = chain()

    def body(tape_class):
        with tape_class(persistent=True) as tape:
            middle = forward(weights[:3], x)
            loss = tf.reduce_sum(forward(weights[3:], middle))
        outside = loss * 2.0
        return tape.gradient(loss, [middle, weights[0]]), tape.gradient(outside, weights[0])

    reference, got, recomputed = both_tapes(body)
    assert recomputed
    assert got[1] is None
    assert_same_structures(reference, got)


def test_non_persistent_tape_stops_recording_and_refuses_a_second_call():
    weights, x = chain()

    def body(tape_class):
        with tape_class() as tape:
            loss = tf.reduce_sum(forward(weights, x))
            first = tape.gradient(loss, weights)
            later = loss * 3.0
        with pytest.raises(RuntimeError, match="non-persistent GradientTape"):
            tape.gradient(later, weights)
        return first

    reference, got, recomputed = both_tapes(body)
    assert recomputed
    assert_same_structures(reference, got)


def test_persistent_tape_gives_gradients_twice_and_reset_forgets():
    weights, x = chain()

    def body(tape_class):
        with tape_class(persistent=True) as tape:
            loss = tf.reduce_sum(forward(weights, x))
            tape.reset()
            second = tf.reduce_sum(forward(weights[1:], x))
        return tape.gradient(second, weights), tape.gradient(second * 2.0, weights[1:]), loss

    reference, got, recomputed = both_tapes(body)
    assert recomputed
    assert got[0][0] is None
    assert_same_structures(reference[:2], got[:2])


def test_target_none_is_rejected():
    weights, x = chain()

    @tf.function
    def step():
        with msg.GradientTape() as tape:
            forward(weights, x)
        tape.gradient(None, weights)

    with pytest.raises(TypeError, match="target=None"):
        step()


def test_eagerly_plain_gradients_and_one_warning(caplog):
    tape_module._log_eager_once.cache_clear()
    weights, x = chain(depth=3)
    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        results = []
        for _ in range(2):
            with msg.GradientTape() as tape:
                loss = tf.reduce_sum(forward(weights, x))
            results.append(tape.gradient(loss, weights))
    with tf.GradientTape() as reference:
        loss = tf.reduce_sum(forward(weights, x))
    assert_same_gradients(reference.gradient(loss, weights), results[0])
    eager_warnings = [r for r in caplog.records if "running eagerly" in r.getMessage()]
    assert len(eager_warnings) == 1


def test_ragged_source_takes_the_plain_path_with_a_warning(caplog):
    @tf.function
    def step(values):
        ragged = tf.RaggedTensor.from_row_lengths(values, [2, 1])
        with msg.GradientTape() as tape:
            tape.watch(ragged)
            loss = tf.reduce_sum(ragged * ragged)
        return tape.gradient(loss, ragged).flat_values

    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        got = step(tf.constant([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(got.numpy(), [2.0, 4.0, 6.0])
    assert any("RaggedTensor" in r.getMessage() for r in caplog.records)


def test_strategy_is_chosen_per_tape():
    weights, x = chain(depth=4)
    kept = []

    @tf.function
    def step():
        with msg.GradientTape(checkpoints=kept) as tape:
            h = forward(weights[:2], x)
            kept.append(h)
            loss = tf.reduce_sum(forward(weights[2:], h))
        return tape.gradient(loss, weights)

    step()
    graph = step.get_concrete_function().graph
    assert_recomputes(graph)
    recomputed = {
        op.name.rsplit("/", 1)[-1] for op in graph.get_operations() if "/recompute_" in op.name
    }
    assert {"Tanh", "Tanh_1"} <= recomputed
    assert not {"Tanh_2", "Tanh_3"} & recomputed


def test_jacobians_are_tensorflows():
    """`jacobian` and `batch_jacobian` call `gradient` inside a loop TensorFlow vectorizes:
    checkpointed there, the jacobian of a weight came back None and batch jacobians wrong.
    They take TensorFlow's own gradients."""
    weights, x = chain()

    def body(tape_class):
        inputs = tf.identity(x)
        with tape_class(persistent=True) as tape:
            tape.watch(inputs)
            h = forward(weights, inputs)
        return tape.jacobian(h, weights[0]), tape.batch_jacobian(h, inputs)

    reference, got, _ = both_tapes(body)
    assert_same_structures(reference, got)
