"""The simulator's own bookkeeping: what it keeps per view while the planner tries plans."""

import gc
import weakref

import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.analysis import costs
from memory_saving_gradients.analysis.view import ForwardView
from memory_saving_gradients.planning import simulation
from memory_saving_gradients.planning.simulation import executor
from memory_saving_gradients.planning.simulation.numbering import Numbering


def test_a_views_numbering_is_made_once_and_forgotten_with_the_view():
    """Inside a tf.function, where a view's tensors do not hash."""
    forgotten = []

    @tf.function(autograph=False)
    def step(x):
        view = ForwardView.build([tf.tanh(x)], [x])
        numbering = Numbering.of(view)
        assert Numbering.of(view) is numbering
        kept = weakref.ref(numbering)
        del view, numbering
        gc.collect()
        forgotten.append(kept() is None)
        return x

    step.get_concrete_function(tf.TensorSpec([2], tf.float32))
    assert forgotten == [True]


@pytest.mark.parametrize("threads, peak_mb", [(1, 6), (2, 8)])
def test_independent_gradients_run_side_by_side_on_more_than_one_thread(
    monkeypatch, threads, peak_mb
):
    """Two branches, each tanh(x) @ w then tanh, summed: each branch's matmul gradient makes
    two 1 MB products while its incoming gradient and what it read are alive. One inter-op
    thread runs the branches one after the other (the incoming gradient takes over the
    tanh output's buffer): 4 MB held by the branches, 2 made. Two run both matmul gradients
    at once, each branch holding its input, incoming gradient and both products: 8 MB.
    Measured in Sessions of one and two inter-op threads: 6.2-7.3 and 7.2-8.3 MB."""
    monkeypatch.setattr(costs, "inter_op_threads", lambda: threads)
    n = 500  # 1 MB tensors
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [n, n])
        weights = [tf.Variable(tf.ones([n, n])) for _ in range(2)]
        loss = tf.add_n([tf.reduce_sum(tf.tanh(tf.tanh(x) @ w)) for w in weights])
        plan = msg.plan(loss, [*weights, x], lambda view: msg.Plan(view, [], "plain"))
    assert plan.plain_peak_bytes == pytest.approx(peak_mb * 1e6, abs=100)


def test_a_gradient_starts_only_once_the_gradients_it_waits_for_have_finished():
    """A diamond 0 -> (1, 2) -> 3 and a chain 3 -> 4: on two threads the branches overlap,
    and every gradient starts after those of its readers finished."""
    unblocks = {0: [], 1: [0], 2: [0], 3: [1, 2], 4: [3]}
    seconds = [1.0, 3.0, 2.0, 1.0, 1.0]
    events = executor.backward_events(range(5), unblocks, seconds, threads=2)
    assert sorted(events) == sorted((op, starts) for op in range(5) for starts in (True, False))
    position = {event: i for i, event in enumerate(events)}
    for op, makers in unblocks.items():
        for maker in makers:
            assert position[(op, False)] < position[(maker, True)]
    assert position[(2, True)] < position[(1, False)]  # side by side
    assert executor.backward_events(range(5), unblocks, seconds, threads=1) == [
        (op, starts) for op in (4, 3, 2, 1, 0) for starts in (True, False)
    ]


def test_xla_runs_its_gradients_one_at_a_time(monkeypatch):
    """The two branches of the test above, compiled by XLA: its schedule runs one op at a
    time whatever the inter-op threads, and measures 6.2 MB."""
    monkeypatch.setattr(costs, "inter_op_threads", lambda: 2)
    n = 500
    weights = [tf.Variable(tf.ones([n, n])) for _ in range(2)]
    x = tf.Variable(tf.ones([n, n]))
    peaks = []

    @tf.function(jit_compile=True)
    def step():
        loss = tf.add_n([tf.reduce_sum(tf.tanh(tf.tanh(x) @ w)) for w in weights])
        plan = msg.plan(loss, [*weights, x], lambda view: msg.Plan(view, [], "plain"))
        peaks.append(plan.plain_peak_bytes)
        return loss

    step.get_concrete_function()
    assert peaks == [pytest.approx(6e6, abs=100)]


def test_a_plan_simulated_up_to_a_limit_answers_as_its_full_simulation():
    """Searches ask whether plans fit: a simulation stops once its peak passes the limit, and
    its answer is the full simulation's at every limit."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4096])
        h, kept = x, []
        for _ in range(16):
            h = tf.tanh(h * 1.5)
            kept.append(h)
        view = ForwardView.build([tf.reduce_sum(h)], [x])
        full = msg.Plan(view, [kept[3::4]], "every fourth").peak_bytes
        assert (
            simulation.checkpointed_peak(msg.Plan(view, [kept[3::4]], "").schedule, full - 1)
            is None
        )
        for limit in (full // 2, full - 1, full, full + 1):
            plan = msg.Plan(view, [kept[3::4]], "every fourth")
            assert plan.peak_within(limit) == (full <= limit), limit
            assert plan.peak_bytes == full
