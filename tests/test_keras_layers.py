"""`msg.keras.layer_outputs` (checkpoints by Keras layer) and `msg.keras.MemoryLog`.

Gradients are compared with TensorFlow's own on models big enough for the layers' outputs to
pay (tanh Dense layers of 128, batch 128), and each comparison checks that forward ops were
recomputed, so it never compares TensorFlow with itself.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.helpers import assert_recomputes, assert_same_gradients

pytestmark = pytest.mark.tf2_only

WIDTH, BATCH = 128, 128
LOGGER = "memory_saving_gradients"


def named_chain(blocks: int = 6) -> keras.Model:
    """tanh Dense blocks named block0_out, block1_out, ..., and a head."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for i in range(blocks):
        h = keras.layers.Dense(WIDTH, activation="tanh", name=f"block{i}_out")(h)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(h))


def shared_and_nested() -> keras.Model:
    """A shared layer called twice, a nested model, a weightless layer on the input, and the
    numbered names Keras gives unnamed layers: "dense" in the nested model, then "dense_1" to
    "dense_6" outside it."""
    keras.backend.clear_session()  # numbered names count from the start of a session
    keras.utils.set_random_seed(0)

    def dense(h, name=None):
        return keras.layers.Dense(WIDTH, activation="tanh", name=name)(h)

    inner_inputs = keras.Input((WIDTH,))
    inner = keras.Model(inner_inputs, dense(dense(inner_inputs, "inner_first")), name="inner")
    inputs = keras.Input((WIDTH,))
    shared = keras.layers.Dense(WIDTH, activation="tanh", name="shared")
    h = dense(keras.layers.Rescaling(0.5, name="scale")(inputs))
    h = shared(dense(dense(shared(h))))
    h = dense(dense(dense(inner(dense(dense(h))))))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(h), name="outer")


def batch(samples: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, WIDTH)).astype("f4")
    return x, rng.standard_normal((samples, 1)).astype("f4")


def loss_of(model: keras.Model, x) -> tf.Tensor:
    return tf.reduce_mean(tf.square(model(x, training=True)))


def tape_step(model: keras.Model, checkpoints):
    """(checkpointed, plain) gradients of one step by the tapes, and the plan the
    checkpointed tape's policy makes, as seen from inside the step."""
    plans = []

    @tf.function(autograph=False)  # errors raised as they are, not as autograph's
    def step(x):
        with msg.GradientTape(checkpoints=checkpoints) as tape:
            loss = loss_of(model, x)
        plans.append(msg.plan(loss, model.trainable_variables, checkpoints=checkpoints))
        with tf.GradientTape() as plain_tape:
            plain_loss = loss_of(model, x)
        checkpointed = tape.gradient(loss, model.trainable_variables)
        assert_recomputes(tf.compat.v1.get_default_graph())
        return checkpointed, plain_tape.gradient(plain_loss, model.trainable_variables)

    checkpointed, plain = step(batch()[0])
    return checkpointed, plain, plans[-1]


def kept_scopes(plan: msg.Plan) -> list[str]:
    """The name scope of each tensor `plan` keeps, the outer model's left out."""
    return sorted("/".join(t.name.split("/")[1:-1]) for t in plan.checkpoints)


def test_fit_with_layer_names_ends_with_the_weights_of_plain_fit():
    x, y = batch()
    models = []
    for policy in (None, msg.keras.layer_outputs("block1_out", "block3_out")):
        model = named_chain()
        if policy is not None:
            msg.keras.enable(model, checkpoints=policy)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        models.append(model)
    plain, enabled = models
    plan = enabled.checkpoint_plan
    assert plan.pays and plan.strategy == "layer_outputs('block1_out', 'block3_out')"
    assert [t.op.type for t in plan.checkpoints] == ["Tanh", "Tanh"]
    assert kept_scopes(plan) == ["block1_out_1", "block3_out_1"]
    for have, want in zip(enabled.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain.get_weights()[0], named_chain().get_weights()[0])


def test_tape_keeps_every_call_of_a_shared_layer_and_nested_layers():
    model = shared_and_nested()
    assert {layer.name for layer in model.layers} >= {"dense_1", "dense_6"}
    checkpointed, plain, plan = tape_step(model, msg.keras.layer_outputs("shared", "dense"))
    assert_same_gradients([g.numpy() for g in plain], [g.numpy() for g in checkpointed])
    # Layer "dense" is the nested model's; the outer model's "dense_1" runs in "dense_1_1".
    assert kept_scopes(plan) == ["inner_1/dense_1", "shared_1", "shared_3"]


def test_gradients_keep_a_nested_models_output():
    model = shared_and_nested()
    policy = msg.keras.layer_outputs("inner")
    x = tf.constant(batch()[0])

    @tf.function(autograph=False)
    def step():
        loss = loss_of(model, x)
        grads = msg.gradients(loss, model.trainable_variables, checkpoints=policy)
        assert_recomputes(tf.compat.v1.get_default_graph())
        plan = msg.plan(loss, model.trainable_variables, checkpoints=policy)
        assert kept_scopes(plan) == ["inner_1/dense_1"]  # the nested model's last op
        return grads, tf.gradients(loss, model.trainable_variables)

    checkpointed, plain = step()
    assert_same_gradients([g.numpy() for g in plain], [g.numpy() for g in checkpointed])


class Block(keras.layers.Layer):
    """A custom layer calling sublayers of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(WIDTH, activation="tanh", name="first")
        self.second = keras.layers.Dense(WIDTH, activation="tanh", name="second")

    def call(self, x):
        return self.second(self.first(x))


def test_sublayers_of_custom_layers_in_a_sequential_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            *(Block(name=f"block{i}") for i in range(4)),
            keras.layers.Dense(1),
        ]
    )
    policy = msg.keras.layer_outputs("block1", "first", model=model)
    checkpointed, plain, plan = tape_step(model, policy)
    assert_same_gradients([g.numpy() for g in plain], [g.numpy() for g in checkpointed])
    # Every block's sublayer "first", and block1's output (made by its sublayer "second").
    assert kept_scopes(plan) == ["block0_1/first_1", "block1_1/first_1", "block1_1/second_1",
                                 "block2_1/first_1", "block3_1/first_1"]  # fmt: skip


def test_predicate_picks_layers_of_the_model():
    model = named_chain()
    policy = msg.keras.layer_outputs(lambda layer: layer.name in ("block2_out", "block4_out"),
                                     model=model)  # fmt: skip
    assert policy.names == ("block2_out", "block4_out")
    checkpointed, plain, plan = tape_step(model, policy)
    assert_same_gradients([g.numpy() for g in plain], [g.numpy() for g in checkpointed])
    assert kept_scopes(plan) == ["block2_out_1", "block4_out_1"]


def test_enable_gives_a_predicate_its_model():
    model = named_chain()
    msg.keras.enable(model, msg.keras.layer_outputs(lambda layer: layer.name == "block2_out"))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(*batch(), batch_size=BATCH, epochs=1, verbose=0)
    assert kept_scopes(model.checkpoint_plan) == ["block2_out_1"]


def test_predicate_without_a_model_says_how_to_give_one():
    policy = msg.keras.layer_outputs(lambda layer: True)
    with pytest.raises(ValueError, match=r"needs the model.*model="):
        tape_step(named_chain(), policy)


def test_model_built_in_remat_scope():
    """Keras's RematScope(mode="activations") wraps each activation in a custom gradient,
    which passes it on through an IdentityN: that is the layer's output kept. (Its other
    modes do not trace on the TensorFlow backend, plain Keras fit included:
    keras-team/keras issue 21207.)"""
    with keras.RematScope(mode="activations"):
        model = named_chain()
    checkpointed, plain, plan = tape_step(model, msg.keras.layer_outputs("block2_out"))
    assert_same_gradients([g.numpy() for g in plain], [g.numpy() for g in checkpointed])
    assert [t.op.type for t in plan.checkpoints] == ["IdentityN"]
    assert kept_scopes(plan) == ["block2_out_1"]


def test_unknown_layer_name_is_an_error_naming_it():
    model = named_chain()
    with pytest.raises(ValueError, match=r"'blok2_out' \(did you mean 'block2_out'\?\)"):
        msg.keras.layer_outputs("block1_out", "blok2_out", model=model)
    with pytest.raises(ValueError, match=r"'blok2_out'.*'block0_out'"):
        msg.keras.enable(model, msg.keras.layer_outputs("blok2_out"))
    with pytest.raises(ValueError, match=r"no layer named 'blok2_out'.*in this graph"):
        tape_step(model, msg.keras.layer_outputs("blok2_out"))


@pytest.mark.parametrize("bad", [(), ("block1_out", len), (3,)])
def test_layer_outputs_takes_names_or_one_predicate(bad):
    with pytest.raises((TypeError, ValueError), match="layer_outputs"):
        msg.keras.layer_outputs(*bad)


def test_layer_outputs_off_the_path_of_gradients_are_named(caplog):
    """The Rescaling layer reads only the input, so its output gets no gradient and cannot
    be a checkpoint: alone it is an error naming it, beside a usable one a warning."""
    model = shared_and_nested()
    with pytest.raises(msg.NoCheckpointsError, match=r"layer 'scale' makes no output"):
        tape_step(model, msg.keras.layer_outputs("scale"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, _, plan = tape_step(model, msg.keras.layer_outputs("scale", "shared"))
    assert kept_scopes(plan) == ["shared_1", "shared_3"]
    assert any("'scale' makes no output" in r.getMessage() for r in caplog.records)


def test_memory_log_adds_peaks_and_saving_to_history():
    """Batches of 512: TensorFlow's CPU allocator statistics leave out requests under
    256 KiB (tests/test_memory.py), which would read as no memory at all."""
    histories = []
    for enabled in (False, True):
        model = named_chain()
        if enabled:
            msg.keras.enable(model, msg.keras.layer_outputs("block1_out", "block3_out"))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        x, y = batch(2048)
        log = msg.keras.MemoryLog()
        history = model.fit(x, y, batch_size=512, epochs=2, verbose=0, callbacks=[log])
        assert len(log.step_peaks) == 4 and min(log.step_peaks) > 0
        histories.append(history.history)
    plain, enabled = histories
    assert set(plain) == {"loss", "peak_memory_mib"}
    keys = {"peak_memory_mib", "predicted_peak_mib", "predicted_plain_peak_mib",
            "predicted_memory_saved_fraction"}  # fmt: skip
    assert set(enabled) == {"loss", *keys}, "no plain step measured: no measured saving"
    assert all(len(enabled[key]) == 2 for key in keys)
    assert all(0 < peak < 64 for peak in enabled["peak_memory_mib"])
    predicted, plain_predicted = (
        enabled["predicted_peak_mib"][0],
        enabled["predicted_plain_peak_mib"][0],
    )
    assert 0 < predicted < plain_predicted
    assert enabled["predicted_memory_saved_fraction"][0] == pytest.approx(
        1 - predicted / plain_predicted
    )


def test_memory_log_sets_the_measured_peak_against_the_measured_plain_step():
    """With `measure=True` the first step is plain and measured: the saving is measured
    against it (it was set against plain's predicted peak, logging 0.63 saved where 0.79 was
    measured), and that plain step is not one of the checkpointed steps' peaks."""
    model = msg.keras.enable(
        named_chain(), msg.keras.layer_outputs("block1_out", "block3_out"), measure=True
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = batch(2048)
    log = msg.keras.MemoryLog()
    history = model.fit(x, y, batch_size=512, epochs=1, verbose=0, callbacks=[log]).history
    assert len(log.step_peaks) == 3
    plain = model.measured_costs.peak_bytes / 2**20
    assert history["plain_peak_memory_mib"] == [plain]
    peak = history["peak_memory_mib"][0]
    assert 0 < peak < plain
    assert history["memory_saved_fraction"] == [pytest.approx(1 - peak / plain)]
    assert "predicted_memory_saved_fraction" in history


def test_memory_log_logs_no_peak_where_the_allocator_shows_none(caplog):
    """Steps of tensors too small for the CPU allocator's statistics read as no allocation:
    that is no saving of everything, so nothing is logged but a warning."""
    model = msg.keras.enable(named_chain(blocks=2), msg.keras.layer_outputs("block0_out"))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = batch(16)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                            callbacks=[msg.keras.MemoryLog()])  # fmt: skip
    assert set(history.history) == {"loss"}
    warnings = [r.getMessage() for r in caplog.records if "MemoryLog" in r.getMessage()]
    assert len(warnings) == 1 and "small tensors" in warnings[0]
