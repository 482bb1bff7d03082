"""The 'memory' planner: optimal cuts for its cost model, about sqrt(n) on chains."""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import planner
from memory_saving_gradients.view import ForwardView
from tests.helpers import assert_same_gradients

tf1 = tf.compat.v1


def brute_force_cheapest(held, cut_bytes, budget):
    """Least total cut size over all cut sets whose segments hold at most `budget`."""
    n = len(held)
    best = math.inf
    for r in range(n):
        for cuts in itertools.combinations(range(n - 1), r):
            bounds = [0, *(c + 1 for c in cuts), n]
            if all(held[a:b].sum() <= budget for a, b in itertools.pairwise(bounds)):
                best = min(best, cut_bytes[list(cuts)].sum())
    return best


@pytest.mark.parametrize("seed", range(30))
def test_cheapest_cuts_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    held = rng.integers(0, 5, n).astype(float)
    cut_bytes = rng.integers(1, 6, n - 1).astype(float)
    budget = float(rng.integers(max(held.max(), 1), held.sum() + 2))
    cuts = planner._cheapest_cuts(held, cut_bytes, budget)
    bounds = [0, *(c + 1 for c in cuts), n]
    assert all(held[a:b].sum() <= budget for a, b in itertools.pairwise(bounds))
    assert cut_bytes[cuts].sum() == brute_force_cheapest(held, cut_bytes, budget)


def chain_view(n, width=100):
    x = tf1.placeholder(tf.float32, [width])
    h = x
    for _ in range(n):
        h = tf.tanh(h * 1.5)
    return ForwardView.build([tf.reduce_sum(h)], [x])


@pytest.mark.parametrize("n", [16, 49, 100])
def test_chain_plan_keeps_about_sqrt_n(n):
    with tf.Graph().as_default():
        plan = planner.plan_checkpoints(chain_view(n))
    assert abs(len(plan.checkpoints) - math.sqrt(n)) <= 2
    assert plan.estimated_peak < 0.5 * plan.estimated_peak_without_checkpoints


def test_tiny_graph_gets_no_plan():
    with tf.Graph().as_default():
        plan = planner.plan_checkpoints(chain_view(1))
    assert plan.checkpoints == ()


def dense_block(x, layers):
    """Every layer reads the concatenation of all earlier ones: no single-tensor separator."""
    features = [x]
    for i in range(layers):
        width = int(x.shape[-1])
        w = tf.Variable(np.random.RandomState(i).randn(width * len(features), width) * 0.1,
                        dtype=tf.float32)  # fmt: skip
        features.append(tf.tanh(tf.matmul(tf.concat(features, axis=-1), w)))
    return features[-1]


def test_dense_skip_connections_still_get_a_plan_and_exact_gradients():
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [8, 16])
        loss = tf.reduce_sum(tf.square(dense_block(x, layers=12)))
        weights = tf1.trainable_variables()
        plan = planner.plan_checkpoints(ForwardView.build([loss], [w.handle for w in weights]))
        assert plan.checkpoints
        reference = tf1.gradients(loss, weights)
        got = msg.gradients(loss, weights, checkpoints="memory")
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            values = session.run([reference, got], {x: np.ones((8, 16), np.float32)})
    assert_same_gradients(*values)


def test_equal_cuts_prefer_tensors_backprop_would_not_hold():
    """A matmul output read only by a tanh dies once recomputation passes it; the tanh output
    would live on for the next matmul's gradient. Both cuts are one tensor."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [8, 32])
        h = x
        for i in range(25):
            h = tf.tanh(tf.matmul(h, tf.Variable(tf.eye(32), name=f"w{i}")))
        weights = tf1.trainable_variables()
        plan = planner.plan_checkpoints(
            ForwardView.build([tf.reduce_sum(h)], [w.handle for w in weights])
        )
    assert plan.checkpoints
    assert {t.op.type for t in plan.checkpoints} == {"MatMul"}
