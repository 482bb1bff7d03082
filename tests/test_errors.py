"""Bad input gets a clear, early error naming what is wrong; tf.gradients options pass through."""

import logging
import re

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.planning import search
from tests.helpers import (
    assert_recomputes,
    assert_same_gradients,
    run_with_nones,
    square_weights,
)

tf1 = tf.compat.v1


def chain(n=6, width=8):
    x = tf1.placeholder(tf.float32, [4, width], name="x")
    ws = [tf.Variable(np.eye(width, dtype=np.float32) * 0.9, name=f"w{i}") for i in range(n)]
    h, hidden = x, []
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
        hidden.append(h)
    return x, ws, hidden, tf.reduce_sum(h * h)


def evaluate(fetches, x):
    with tf1.Session() as session:
        session.run(tf1.global_variables_initializer())
        return run_with_nones(session, fetches, {x: np.ones(x.shape, np.float32)})


@pytest.mark.tf2_only
def test_eager_call_says_to_use_a_graph():
    with pytest.raises(RuntimeError, match=r"tf\.function"):
        msg.gradients(tf.constant(1.0), tf.constant(2.0))


def test_unknown_strategy_lists_the_known_ones():
    with tf.Graph().as_default():
        _, ws, _, loss = chain()
        with pytest.raises(
            ValueError, match=r"'fast'.*\['balanced', 'collection', 'memory', 'speed'\]"
        ):
            msg.gradients(loss, ws, checkpoints="fast")


@pytest.mark.parametrize(
    "make",
    [
        lambda checkpoints: msg.GradientTape(checkpoints=checkpoints),
        lambda checkpoints: msg.patch(checkpoints),
    ],
    ids=["tape", "patch"],
)
def test_unknown_strategy_is_refused_where_it_is_given(make):
    try:
        with pytest.raises(ValueError, match=r"'sped'.*\['balanced', 'collection'"):
            make("sped")
        with pytest.raises(TypeError, match=r"must be a strategy name.*got 3"):
            make(3)
    finally:
        msg.unpatch()


@pytest.mark.parametrize("fraction", [0, -0.5, "0.3", True, 1, 2.0, 40])
def test_memory_budget_refuses_what_is_no_fraction_between_0_and_1(fraction):
    """MemoryBudget(40), meant as 40%, computed plain gradients and said nothing."""
    expected = (
        rf"MemoryBudget fraction {re.escape(repr(fraction))} is not between 0 and 1.*"
        r"MemoryBudget\(0\.4\) for 40%.*bytes=2\*\*30"
    )
    with pytest.raises(ValueError, match=expected):
        msg.MemoryBudget(fraction)


@pytest.mark.parametrize(
    "arguments", [{"bytes": 0}, {"bytes": -1}, {"fraction": 0.5, "bytes": 10}, {}]
)
def test_memory_budget_takes_a_fraction_or_a_positive_number_of_bytes(arguments):
    with pytest.raises(ValueError, match=r"MemoryBudget.*bytes=2\*\*30"):
        msg.MemoryBudget(**arguments)


@pytest.mark.parametrize("scratch", [-1, float("nan"), float("inf"), "2", True, None])
def test_update_scratch_must_be_a_number_of_gradients_bytes(scratch):
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        y = tf.tanh(tf.tanh(w * 2.0))
        for call in (msg.gradients, msg.plan):
            with pytest.raises(ValueError, match=r"update_scratch=.*\(2 for Adam"):
                call(y, [w], checkpoints="memory", update_scratch=scratch)


def test_memory_budget_too_small_to_meet_takes_memorys_plan_and_says_so_once(caplog, monkeypatch):
    """Below reach, a budget took a plan of the same peak as 'memory''s recomputing three
    times as much, and warned once per model built."""
    monkeypatch.setattr(search, "_SAID_BELOW_REACH", set(), raising=False)
    caplog.set_level(logging.INFO, logger="memory_saving_gradients")
    budget = msg.MemoryBudget(0.001)
    for depth in (8, 12):
        with tf.Graph().as_default():
            x = tf1.placeholder(tf.float32, [64, 32])
            ws = square_weights(depth, 32)
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w) + 1.0)
            loss = tf.reduce_sum(h * h)
            chosen, memory = (
                msg.plan(loss, ws, checkpoints=budget),
                msg.plan(loss, ws, checkpoints="memory"),
            )
        assert chosen.levels == memory.levels
        assert chosen.recompute_flops_fraction == memory.recompute_flops_fraction
    below = [r for r in caplog.records if "MemoryBudget(0.001) (" in r.getMessage()]
    assert [r.levelno for r in below] == [logging.WARNING, logging.INFO], caplog.text
    assert "is below the least predicted peak: using the plan of checkpoints='memory'" in (
        below[0].getMessage()
    )


def test_checkpoint_that_is_an_operation_says_which_output_to_pass():
    with tf.Graph().as_default():
        _, ws, hidden, loss = chain()
        with pytest.raises(TypeError, match=r"Tanh_2.*operation.*outputs\[0\]"):
            msg.gradients(loss, ws, checkpoints=[hidden[2].op])


def test_checkpoint_names_resolve_and_unknown_names_fail():
    with tf.Graph().as_default():
        _, ws, hidden, loss = chain()
        msg.gradients(loss, ws, checkpoints=[hidden[2].name])
        assert_recomputes(tf1.get_default_graph())
        with pytest.raises(TypeError, match="'nope:0'"):
            msg.gradients(loss, ws, checkpoints=["nope:0"])


def test_checkpoint_of_another_graph_is_rejected():
    with tf.Graph().as_default():
        elsewhere = tf.constant(1.0, name="elsewhere")
    with tf.Graph().as_default():
        _, ws, _, loss = chain()
        with pytest.raises(TypeError, match=r"elsewhere.*another graph"):
            msg.gradients(loss, ws, checkpoints=[elsewhere])
        with pytest.raises(TypeError, match="not a graph tensor"):
            msg.gradients(loss, ws, checkpoints=[3.0])
        with pytest.raises(TypeError, match="list of tensors"):
            msg.gradients(loss, ws, checkpoints=42)


def test_empty_collection_says_how_to_fill_it():
    with tf.Graph().as_default():
        _, ws, _, loss = chain()
        with pytest.raises(msg.NoCheckpointsError, match="add_checkpoint"):
            msg.gradients(loss, ws)


def test_speed_without_matmul_suggests_memory():
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3])
        with pytest.raises(msg.NoCheckpointsError, match="'memory'"):
            msg.gradients_speed(tf.reduce_sum(tf.tanh(tf.sin(x))), x)


def test_speed_names_the_matmuls_it_finds_kept_anyway():
    """Where every matmul is an op never recomputed, inside a cond (a TF1 control-flow frame,
    or a TF2 cond reading a variable), 'speed' has none to keep: the refusal names them and
    why, rather than saying the forward pass has none."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [4, 8])
        h, ws = x, square_weights(2, 8)
        for w in ws:
            h = tf.cond(tf.constant(True), lambda h=h, w=w: tf.tanh(h @ w), lambda h=h: h) * 1.5
        with pytest.raises(msg.NoCheckpointsError, match=r"never recomputed.*\['cond"):
            msg.gradients_speed(tf.reduce_sum(h), ws)


def test_refusals_inside_tf_function_keep_their_type():
    """Raised through AutoGraph's converted code, the error is still a NoCheckpointsError
    (it used to arrive as a StagingError)."""

    @tf.function
    def step(x):
        return msg.gradients_speed(tf.reduce_sum(tf.tanh(tf.sin(x))), x)

    with pytest.raises(msg.NoCheckpointsError, match="'memory'"):
        step(tf.ones([3]))


def test_unusable_checkpoints_are_logged_with_the_reason(caplog):
    with tf.Graph().as_default():
        x, ws, hidden, loss = chain()
        off_path = tf.tanh(tf.ones([3]), name="off_path")
        weight_read = hidden[0].op.inputs[0].op.inputs[1]
        caplog.set_level(logging.WARNING, logger="memory_saving_gradients")
        with pytest.raises(msg.NoCheckpointsError, match="checkpoint list"):
            msg.gradients(loss, ws, checkpoints=[off_path, x, weight_read])
        assert "off_path:0: it is not between xs and ys" in caplog.text
        assert "x:0: it is not between xs and ys" in caplog.text
        assert f"{weight_read.name}: its op is never recomputed" in caplog.text


def test_memory_falls_back_to_plain_gradients_on_tiny_graphs(caplog):
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [4, 8])
        w = tf.Variable(np.ones((8, 8), np.float32))
        loss = tf.reduce_sum(tf.matmul(x, w))
        caplog.set_level(logging.INFO, logger="memory_saving_gradients")
        got = msg.gradients_memory(loss, [w])
        reference = tf1.gradients(loss, [w])
        assert "plain gradients" in caplog.text
        assert_same_gradients(*evaluate([reference, got], x))


def test_xs_of_another_graph_are_named():
    with tf.Graph().as_default():
        stranger = tf.constant(1.0, name="stranger")
    with tf.Graph().as_default():
        loss = chain()[-1]
        with pytest.raises(ValueError, match="xs entry stranger"):
            msg.gradients(loss, [stranger], checkpoints="memory")


def test_grad_ys_count_must_match_ys():
    with tf.Graph().as_default():
        _, ws, _, loss = chain()
        with pytest.raises(ValueError, match="2 grad_ys for 1 ys"):
            msg.gradients(loss, ws, grad_ys=[1.0, 2.0], checkpoints="memory")


def test_sparse_ys_are_rejected():
    with tf.Graph().as_default():
        ws = chain()[1]
        sparse = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]))
        with pytest.raises(TypeError, match="dense tensors"):
            msg.gradients(sparse, ws, checkpoints="memory")


@pytest.mark.parametrize("unconnected", ["none", "zero"])
def test_unconnected_xs_like_tf_gradients(unconnected):
    with tf.Graph().as_default():
        x, ws, hidden, loss = chain()
        lonely = tf.Variable(np.ones((2, 3), np.float32), name="lonely")
        xs = [*ws, lonely, lonely.handle]
        reference = tf1.gradients(loss, xs, unconnected_gradients=unconnected)
        got = msg.gradients(loss, xs, checkpoints=hidden[::2], unconnected_gradients=unconnected)
        assert (got[-1] is None) == (unconnected == "none")
        assert_same_gradients(*evaluate([reference, got], x))


def test_stop_gradients_inside_a_recomputed_segment():
    with tf.Graph().as_default():
        x, ws, hidden, loss = chain()
        stops = [hidden[1], hidden[4]]
        reference = tf1.gradients(loss, ws, stop_gradients=stops)
        got = msg.gradients(loss, ws, checkpoints=[hidden[2]], stop_gradients=stops)
        assert_same_gradients(*evaluate([reference, got], x))


def test_stop_gradients_on_a_checkpoint():
    with tf.Graph().as_default():
        x, ws, hidden, loss = chain()
        reference = tf1.gradients(loss, ws, stop_gradients=[hidden[3]])
        got = msg.gradients(loss, ws, checkpoints=[hidden[3]], stop_gradients=[hidden[3]])
        assert_same_gradients(*evaluate([reference, got], x))


@pytest.mark.parametrize(
    "options",
    [
        {"gate_gradients": True},
        {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE},
        {"colocate_gradients_with_ops": False},
        {"name": "my_gradients"},
    ],
)
def test_tf_gradients_options_pass_through(options):
    with tf.Graph().as_default():
        x, ws, hidden, loss = chain()
        reference = tf1.gradients(loss, ws, **options)
        got = msg.gradients(loss, ws, checkpoints=hidden[1::2], **options)
        assert_same_gradients(*evaluate([reference, got], x))


def test_duplicate_xs_get_the_same_gradient():
    with tf.Graph().as_default():
        x, ws, _, loss = chain()
        reference = tf1.gradients(loss, [ws[0], ws[1], ws[0]])
        got = msg.gradients(loss, [ws[0], ws[1], ws[0]], checkpoints="memory")
        assert got[0] is got[2]
        assert_same_gradients(*evaluate([reference, got], x))


def test_ys_of_two_graphs_are_rejected():
    with tf.Graph().as_default():
        other = tf.constant(1.0, name="other_y")
    with tf.Graph().as_default():
        _, ws, _, loss = chain()
        with pytest.raises(ValueError, match="ys entry other_y"):
            msg.gradients([loss, other], ws, checkpoints="memory")


def test_grad_ys_of_the_wrong_dtype_or_shape_are_rejected():
    with tf.Graph().as_default():
        _, ws, hidden, _ = chain()
        y = hidden[-1]
        with pytest.raises(TypeError, match=r"grad_ys\[0\] has dtype float64.*tf\.cast"):
            msg.gradients(y, ws, grad_ys=tf.ones(y.shape, tf.float64), checkpoints="memory")
        with pytest.raises(ValueError, match=r"grad_ys\[0\] has shape \(3, 8\)"):
            msg.gradients(y, ws, grad_ys=tf.ones([3, 8]), checkpoints="memory")


def test_unreachable_xs_are_reported(caplog):
    with tf.Graph().as_default():
        _, ws, _, loss = chain()
        lonely = tf.Variable(1.0, name="lonely")
        caplog.set_level(logging.INFO, logger="memory_saving_gradients")
        msg.gradients(loss, [*ws, lonely], checkpoints="memory")
        assert "ys do not depend on xs ['lonely:0']" in caplog.text
        caplog.clear()
        assert msg.gradients(loss, [lonely], checkpoints="memory") == [None]
        assert any(
            r.levelno == logging.WARNING and "any of xs ['lonely:0']" in r.message
            for r in caplog.records
        )


@pytest.mark.tf2_only
def test_eager_tensors_as_checkpoints_are_rejected():
    eager = tf.constant(1.0)
    with tf.Graph().as_default():
        _, ws, _, loss = chain()
        with pytest.raises(TypeError, match="not a graph tensor"):
            msg.gradients(loss, ws, checkpoints=[eager])
