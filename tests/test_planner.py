"""The 'memory' planner: optimal cuts for its cost model, about sqrt(n) on chains."""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning import cut_search
from memory_saving_gradients._src.planning.plans import Plan
from tests.helpers import assert_same_gradients

tf1 = tf.compat.v1


def peak_of(held, gradients, cut_bytes, cuts):
    """The largest "cuts before + what the segment still holds + gradients made", as backprop
    reaches each op of each segment that `cuts` make."""
    starts = [0, *(c + 1 for c in cuts)]
    ends = [*(c + 1 for c in cuts), len(held)]
    spent = np.concatenate([[0.0], np.cumsum(cut_bytes[list(cuts)])])
    return max(
        spent[j] + held[a : k + 1].sum() + gradients[k]
        for j, (a, b) in enumerate(zip(starts, ends, strict=True))
        for k in range(a, b)
    )


def all_cut_sets(n):
    return itertools.chain.from_iterable(itertools.combinations(range(n - 1), r) for r in range(n))


def random_costs(seed):
    """Random held bytes, gradients held (for half the seeds; growing towards the start, as
    backprop makes more of them), cut costs and peak, and every cut set meeting that peak."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    held = rng.integers(0, 6, n).astype(float)
    gradients = np.cumsum(rng.integers(0, 3, n)[::-1])[::-1].astype(float) * (seed % 2)
    cut_bytes = rng.integers(1, 4, n - 1).astype(float)
    peak = float(rng.integers((held + gradients).max(), (np.cumsum(held) + gradients).max() + 1))
    feasible = [c for c in all_cut_sets(n) if peak_of(held, gradients, cut_bytes, c) <= peak]
    return held, gradients, cut_bytes, peak, feasible


@pytest.mark.parametrize("seed", range(40))
def test_cuts_within_a_peak_match_brute_force(seed):
    held, gradients, cut_bytes, peak, feasible = random_costs(seed)
    cuts = cut_search._cuts_within(held, gradients, cut_bytes, peak)
    if not feasible:
        assert cuts is None
        return
    assert cuts is not None and peak_of(held, gradients, cut_bytes, cuts) <= peak
    assert cut_bytes[cuts].sum() == min(cut_bytes[list(c)].sum() for c in feasible)


@pytest.mark.parametrize("seed", range(40))
def test_cuts_with_the_longest_last_segment_match_brute_force(seed):
    held, gradients, cut_bytes, peak, feasible = random_costs(seed)
    cuts = cut_search._cuts_within(held, gradients, cut_bytes, peak, longest_last_segment=True)
    if not feasible:
        assert cuts is None
        return

    def last_start(c):
        return c[-1] + 1 if c else 0

    earliest = min(last_start(c) for c in feasible)
    assert cuts is not None and peak_of(held, gradients, cut_bytes, cuts) <= peak
    assert last_start(cuts) == earliest
    assert cut_bytes[cuts].sum() == min(
        cut_bytes[list(c)].sum() for c in feasible if last_start(c) == earliest
    )


def chain_view(n, width=100):
    x = tf1.placeholder(tf.float32, [width])
    h = x
    for _ in range(n):
        h = tf.tanh(h * 1.5)
    return ForwardView.build([tf.reduce_sum(h)], [x])


def residual_view(n, width=100):
    """n blocks of `h = h + tanh(h * 1.5)`: every cut holds the block's input, which the
    block's add reads again."""
    x = tf1.placeholder(tf.float32, [width])
    h = x
    for _ in range(n):
        h = h + tf.tanh(h * 1.5)
    return ForwardView.build([tf.reduce_sum(h)], [x])


def order_of(view):
    return cut_search.Order.of(view, view.costs)


def positions(tensors):
    return sorted(int(t.op.name.split("_")[-1]) if "_" in t.op.name else 0 for t in tensors)


@pytest.mark.parametrize("n", [16, 49, 100])
def test_chain_plan_keeps_about_sqrt_2n_in_shrinking_segments(n):
    with tf.Graph().as_default():
        order = order_of(chain_view(n))
        cuts, peak = cut_search.smallest_peak(order)
        (checkpoints,) = cut_search.checkpoints_of(order, cuts)
    assert abs(len(checkpoints) - math.sqrt(2 * n)) <= 2
    gaps = np.diff(positions(checkpoints))
    assert all(gaps[:-1] >= gaps[1:]), positions(checkpoints)
    assert peak < 2 * math.sqrt(n) / n * order.held.sum()
    assert cut_search.model_peak(order, cuts) == pytest.approx(peak, rel=1e-6)


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8])
def test_cuts_within_a_peak_fit_and_start_their_last_segment_earlier(fraction):
    with tf.Graph().as_default():
        order = order_of(chain_view(64))
        smallest, _ = cut_search.smallest_peak(order)
        cuts = cut_search.within(order, fraction * order.held.sum())
    assert cuts.levels == 1
    assert cut_search.model_peak(order, cuts) <= fraction * order.held.sum()
    assert cuts.positions[-1] < smallest.positions[-1]
    assert cut_search.recompute_work(order, cuts) < cut_search.recompute_work(order, smallest)


@pytest.mark.parametrize("n", [64, 256])
def test_peaks_below_one_level_nest(n):
    """One level of cuts bottoms out near sqrt(2n) activations; below, segments are cut again,
    each level costing about one more forward pass."""
    with tf.Graph().as_default():
        order = order_of(chain_view(n))
        _, smallest = cut_search.smallest_peak(order)
        target = 0.7 * smallest
        cuts = cut_search.within(order, target)
        levels = cut_search.checkpoints_of(order, cuts)
    assert cuts is not None and cuts.levels >= 2
    assert cut_search.model_peak(order, cuts) <= target
    forward = order.compute.sum()
    assert forward < cut_search.recompute_work(order, cuts) <= (cuts.levels + 0.5) * forward
    assert len(levels) == cuts.levels and all(levels)


def test_nesting_reaches_about_log_n_activations():
    n = 512
    with tf.Graph().as_default():
        order = order_of(chain_view(n))
    activation = order.held.max()
    _, smallest = cut_search.smallest_peak(order)
    assert smallest > 30 * activation  # about sqrt(2n) = 32
    assert cut_search.within(order, 2 * math.log2(n) * activation) is not None


def test_a_peak_below_any_nesting_is_refused():
    with tf.Graph().as_default():
        order = order_of(chain_view(64))
    assert cut_search.within(order, 0.5 * order.held.max()) is None


def test_search_reuses_what_it_found_without_changing_answers():
    """`within` answers from what it searched before on the same order (the nested search
    meets the same segments under many top-level cuts): a sweep of peaks gives the same cuts
    on one order as on a fresh order for each peak."""
    with tf.Graph().as_default():
        view = residual_view(48)
        shared = order_of(view)
        _, smallest = cut_search.smallest_peak(shared)
        peaks = [smallest * f for f in (0.9, 0.5, 0.7, 0.4, 0.6, 0.45, 0.9, 0.3, 1.2)]
        answers = [cut_search.within(shared, peak) for peak in peaks]
        fresh = [cut_search.within(order_of(view), peak) for peak in peaks]
    assert answers == fresh
    assert any(cuts is not None and cuts.levels >= 3 for cuts in answers)
    assert shared.searched


def test_tiny_graph_gets_no_cuts():
    with tf.Graph().as_default():
        order = order_of(chain_view(1))
        cuts, _ = cut_search.smallest_peak(order)
    assert cuts.positions == ()


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
        plan = msg.plan(loss, weights, checkpoints="memory")
        assert plan.checkpoints
        reference = tf1.gradients(loss, weights)
        got = msg.gradients(loss, weights, checkpoints=plan)
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
        plan = msg.plan(tf.reduce_sum(h), tf1.trainable_variables(), checkpoints="memory")
    assert plan.checkpoints
    assert {t.op.type for t in plan.checkpoints} == {"MatMul"}


def loss_tail_model(x: tf.Tensor, weights: list) -> tf.Tensor:
    """GELU blocks, logits and a softmax cross-entropy summed, as a language model's loss."""
    h = x
    for w in weights[:-1]:
        h = h + tf.nn.gelu(tf.matmul(h, w))
    labels = tf.constant(np.arange(x.shape[0]) % weights[-1].shape[1], tf.int32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.matmul(h, weights[-1]))
    return tf.reduce_sum(losses) / x.shape[0]


def test_the_segment_backprop_reaches_first_is_not_recomputed():
    """A plan keeping the summed loss would recompute the cross-entropy behind it right after
    the forward pass made it (a small part of the peak): `as_it_ran_first` drops that
    checkpoint, its predicted peak no higher, the cross-entropy differentiated as it ran and
    gradients those of tf.gradients."""
    from memory_saving_gradients._src.planning import search

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 256)).astype("f4")
    with tf.Graph().as_default() as graph:
        shapes = [(256, 256)] * 6 + [(256, 64)]
        weights = [tf.Variable(rng.normal(0, 0.1, shape).astype("f4")) for shape in shapes]
        inputs = tf.compat.v1.placeholder(tf.float32, x.shape)
        loss = loss_tail_model(inputs, weights)
        found = {}

        def keep_the_sum(view):
            blocks = [op.outputs[0] for op in view.ops if op.type == "AddV2"]
            logits = [op.outputs[0] for op in view.ops if op.type == "MatMul"][-1]
            found["sum"] = [op.outputs[0] for op in view.ops if op.type == "Sum"][-1]
            found["plan"] = Plan(view, [[*blocks[1::2], logits, found["sum"]]], "sum kept")
            found["trimmed"] = search.as_it_ran_first(found["plan"])
            return found["trimmed"]

        got = msg.gradients(loss, weights, checkpoints=keep_the_sum)
        plan, trimmed = found["plan"], found["trimmed"]
        assert found["sum"].ref() not in {t.ref() for t in trimmed.checkpoints}, trimmed
        assert trimmed.checkpoints and trimmed.peak_bytes <= plan.peak_bytes
        assert trimmed.recompute_flops_fraction < plan.recompute_flops_fraction
        copies = [op.type for op in graph.get_operations() if "/recompute_" in op.name]
        assert copies and "SparseSoftmaxCrossEntropyWithLogits" not in copies, copies
        want = tf.compat.v1.gradients(loss, weights)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            got, want = session.run([got, want], {inputs: x})
    assert_same_gradients(want, got)
