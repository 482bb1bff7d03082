"""The simulator's own bookkeeping: what it keeps per view while the planner tries plans."""

import dataclasses
import gc
import json
import weakref

import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.analysis import costs, gradient_uses, kernels
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning import simulation
from memory_saving_gradients._src.planning.simulation import executor
from memory_saving_gradients._src.planning.simulation.numbering import Numbering, kernel_seconds
from tests.helpers import run_python


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


@pytest.mark.parametrize("threads, peak_mb", [(1, 6), (2, 7)])
def test_independent_gradients_run_side_by_side_on_more_than_one_thread(
    monkeypatch, threads, peak_mb
):
    """Two branches, each tanh(x) @ w then tanh, summed: each branch's matmul gradient makes
    two 1 MB products while its incoming gradient and what it read are alive. One inter-op
    thread runs the branches one after the other (the incoming gradient takes over the
    tanh output's buffer): 4 MB held by the branches, 2 made. Two run the branches side by
    side, each running its matmul gradient's two kernels one after the other: 7 MB.
    Measured in Sessions of one and two inter-op threads (the gradients reduced to sums,
    eight runs each): 5.3 and 6.3 MB, two threads 1 MB above one, as predicted."""
    monkeypatch.setattr(kernels, "inter_op_threads", lambda: threads)
    n = 500  # 1 MB tensors
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [n, n])
        weights = [tf.Variable(tf.ones([n, n])) for _ in range(2)]
        loss = tf.add_n([tf.reduce_sum(tf.tanh(tf.tanh(x) @ w)) for w in weights])
        plan = msg.plan(loss, [*weights, x], checkpoints=lambda view: msg.Plan(view, [], "plain"))
    assert plan.plain_peak_bytes == pytest.approx(peak_mb * 1e6, abs=100)


def test_a_gradient_starts_only_once_the_gradients_it_waits_for_have_finished():
    """A diamond 0 -> (1, 2) -> 3 and a chain 3 -> 4: on two threads the branches overlap,
    and every gradient starts after those of its readers finished."""
    unblocks = {0: [], 1: [0], 2: [0], 3: [1, 2], 4: [3]}
    seconds = [1.0, 3.0, 2.0, 1.0, 1.0]
    tasks = {op: [executor.Kernel(seconds[op], makers)] for op, makers in unblocks.items()}
    events = executor.backward_events(range(5), tasks, threads=2)
    assert sorted(events) == sorted((op, 0, starts) for op in range(5) for starts in (True, False))
    position = {(op, starts): i for i, (op, _, starts) in enumerate(events)}
    for op, makers in unblocks.items():
        for maker in makers:
            assert position[(op, False)] < position[(maker, True)]
    assert position[(2, True)] < position[(1, False)]  # side by side
    assert executor.backward_events(range(5), tasks, threads=1) == [
        (op, 0, starts) for op in (4, 3, 2, 1, 0) for starts in (True, False)
    ]


def test_what_a_gradients_fast_kernel_makes_goes_on_while_its_slow_kernel_runs():
    """A chain 0 -> 1 -> 2 where op 1's gradient has a fast kernel making op 0's input's
    gradient and a slow one making a weight's: op 0's gradient starts on the other thread as
    the fast kernel finishes, while the slow one still runs."""
    tasks = {
        0: [executor.Kernel(1.0, [])],
        1: [executor.Kernel(1.0, [0]), executor.Kernel(5.0, [])],
        2: [executor.Kernel(1.0, [1])],
    }
    events = executor.backward_events(range(3), tasks, threads=2)
    position = {event: i for i, event in enumerate(events)}
    assert position[(1, 0, False)] < position[(0, 0, True)] < position[(1, 1, False)]
    assert position[(0, 0, False)] < position[(1, 1, False)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_kernel_waiting_for_its_sibling_starts_once_the_sibling_has_finished(threads):
    """A product's gradient whose first kernel (the larger operand's gradient) waits for its
    second, below another op's gradient: on any number of threads the second finishes
    before the first starts (NOTE [a product's gradient frees before it makes])."""
    tasks = {
        0: [executor.Kernel(1.0, [], after=(1,)), executor.Kernel(3.0, [])],
        1: [executor.Kernel(1.0, [0])],
    }
    events = executor.backward_events(range(2), tasks, threads)
    assert sorted(events) == sorted(
        (op, kernel, starts) for op, kernel in ((0, 0), (0, 1), (1, 0)) for starts in (True, False)
    )
    assert events.index((0, 1, False)) < events.index((0, 0, True))


def test_xla_runs_its_gradients_one_at_a_time(monkeypatch):
    """The two branches of the test above, compiled by XLA: its schedule runs one op at a
    time whatever the inter-op threads, and measures 6.2 MB."""
    monkeypatch.setattr(kernels, "inter_op_threads", lambda: 2)
    n = 500
    weights = [tf.Variable(tf.ones([n, n])) for _ in range(2)]
    x = tf.Variable(tf.ones([n, n]))
    peaks = []

    @tf.function(jit_compile=True)
    def step():
        loss = tf.add_n([tf.reduce_sum(tf.tanh(tf.tanh(x) @ w)) for w in weights])
        plan = msg.plan(loss, [*weights, x], checkpoints=lambda view: msg.Plan(view, [], "plain"))
        peaks.append(plan.plain_peak_bytes)
        return loss

    step.get_concrete_function()
    assert peaks == [pytest.approx(6e6, abs=100)]


_WEIGHT_GRADIENT_FIRST = """
import json
import numpy as np
import tensorflow as tf
import memory_saving_gradients as msg
from memory_saving_gradients.cli.suites import trace
from tests.test_selective import read_in_place

tf.compat.v1.disable_eager_execution()
tf.config.threading.set_inter_op_parallelism_threads(1)
with tf.Graph().as_default() as graph:
    x = tf.compat.v1.placeholder(tf.float32, [1024, 256])
    weights = [tf.Variable(tf.fill([256, 1024], 0.01)), tf.Variable(tf.fill([1024, 256], 0.01))]
    wide = tf.matmul(x, weights[0]) + 1.0
    loss = tf.reduce_sum(tf.matmul(wide, weights[1]))
    plain = lambda view: msg.Plan(view, [], "plain")
    plan = msg.plan(loss, weights, checkpoints=plain, gradients_held=True)
    grads = tf.gradients(loss, weights)
    init = tf.compat.v1.global_variables_initializer()
config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
feed = {x: read_in_place(np.ones([1024, 256], np.float32))}
with tf.compat.v1.Session(graph=graph, config=config) as session:
    session.run(init)
    session.run(grads, feed)
    requested = trace.profiled(lambda: session.run(grads, feed)).requested_peak
print(json.dumps([plan.plain_peak_bytes, requested]))
"""


def test_a_products_input_is_let_go_by_its_weight_gradient_before_its_data_gradient_is_made():
    """On one inter-op thread the executor runs a matrix product's weight gradient first (the
    last kernel made ready runs inline), and that kernel is the last to read the product's 4
    MiB input: it is freed before the 4 MiB data gradient is made. The step fetches both
    weights' gradients (held to its end: no update's temporaries to model) from a fed input
    read in place. Predicted as profiled in a Session of one inter-op thread (the process's
    pool set to one for the plan), in a fresh interpreter: 6 MiB (the data gradient and both
    weight gradients), where holding the input to the op's last kernel predicted 9."""
    predicted, requested = json.loads(run_python("-c", _WEIGHT_GRADIENT_FIRST).splitlines()[-1])
    assert predicted == pytest.approx(requested, rel=0.05), (predicted, requested)
    assert predicted < 8 * 2**20, predicted


_PLAIN_PEAK_OF_A_FUNCTION = """
import json
import sys
import tensorflow as tf
import memory_saving_gradients as msg
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients.cli.suites import trace

tf.config.threading.set_inter_op_parallelism_threads(1)
n, blocks = int(sys.argv[1]), int(sys.argv[2])
weights = [tf.Variable(tf.fill([n, n], 0.001)) for _ in range(blocks)]
found = []


@tf.function(input_signature=[tf.TensorSpec([n, n]), tf.TensorSpec([n, n], tf.int32)])
def step(x, tokens):
    h = x
    for w in weights:
        mask = tf.minimum(tokens, 1) > 0  # each block's own ops, all alike
        h = tf.where(mask, tf.tanh(h @ w), 0.0)
    loss = tf.reduce_sum(tf.tanh(h))
    plain = lambda view: msg.Plan(view, [], "plain")
    plan = msg.plan(loss, weights, checkpoints=plain, gradients_held=True)
    found.append([plan.plain_peak_bytes, len(execution_of(plan._view).made_outside)])
    return tf.gradients(loss, weights)


x, tokens = tf.ones([n, n]), tf.ones([n, n], tf.int32)
step(x, tokens)
print(json.dumps([*found[0], trace.profiled(lambda: step(x, tokens)).requested_peak]))
"""


def _plain_peak_of_masked_blocks(n: int, blocks: int) -> tuple[int, int, int]:
    """Predicted plain peak, tensors held from outside the view, and requested peak (profiled,
    fresh interpreter, one inter-op thread) of `blocks` blocks `where(mask, tanh(h @ w), 0)` of
    n by n, each block computing its mask from the step's input alike, and a tanh on top."""
    output = run_python("-c", _PLAIN_PEAK_OF_A_FUNCTION, str(n), str(blocks))
    return tuple(json.loads(output.splitlines()[-1]))


def test_a_selects_gradient_writes_into_the_gradient_it_reads():
    """One 4 MiB block: the select's gradient `where(mask, g, 0)` writes into `g`, which dies
    there, as its forward writes into a dying input: the peak is the 4 MiB matmul output, the
    top tanh's output holding the gradient and the 1 MiB mask (9 MiB), not 13 with the
    select's own."""
    predicted, held, requested = _plain_peak_of_masked_blocks(1024, 1)
    assert held == 1
    assert predicted == pytest.approx(requested, abs=1024), (predicted, requested)


def test_masks_that_identical_ops_compute_are_held_once():
    """Eight blocks each compute their 256 KiB mask from the step's input with ops of their
    own, all alike: graph optimizers merge them (NOTE [identical ops are merged]), so one
    mask is alive to the end of backprop, not eight (1.75 MiB more on 16)."""
    predicted, held, requested = _plain_peak_of_masked_blocks(512, 8)
    assert held == 1
    assert predicted == pytest.approx(requested, abs=1024), (predicted, requested)


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


def test_a_gradients_kernels_are_grouped_by_the_steps_they_share():
    """A convolution's input and filter gradients, and a product's two factors', are kernels
    apart (they share only shapes); a fused batch norm's gradient is one kernel for all."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 4])
        w = tf.compat.v1.placeholder(tf.float32, [3, 3, 4, 8])
        convolution = gradient_uses.gradient_use(tf.nn.conv2d(x, w, 1, "SAME").op)
        product = gradient_uses.gradient_use((x * tf.ones([4])).op)
        scale = tf.ones([4])
        batch_norm = gradient_uses.gradient_use(
            tf.compat.v1.nn.fused_batch_norm(x, scale, tf.zeros([4]), is_training=True)[0].op
        )
    assert convolution.kernels([True, True]) == ((0,), (1,))
    assert convolution.kernels([False, True]) == ((1,),)
    assert product.kernels([True, True]) == ((0,), (1,))
    assert batch_norm.kernels([True, True, True, False, False]) == ((0, 1, 2),)


def test_a_gradients_kernels_are_timed_as_measured_else_share_its_time():
    """Measured, each kernel takes its steps' measured time; static, the gradient's time (twice
    its op's compute) is shared by the kernels that compute, and a gradient passed on
    unchanged (a BiasAdd's input's) is ready at once."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 16, 16, 4])
        w = tf.compat.v1.placeholder(tf.float32, [3, 3, 4, 8])
        y = tf.nn.conv2d(x, w, 1, "SAME")
        biased = tf.nn.bias_add(y, tf.ones([8]))
        conv = costs.op_cost(y.op, lambda t: True)
        bias = costs.op_cost(biased.op, lambda t: True)
    two = ((0,), (1,))
    assert kernel_seconds(conv, two) == [conv.flops, conv.flops]
    assert kernel_seconds(bias, two) == [0.0, 2.0 * bias.flops]
    measured = dataclasses.replace(
        conv,
        seconds=1.0,
        gradient_seconds=3.0,
        gradient_kernel_seconds=(("Conv2DBackpropFilter", 2.5), ("Conv2DBackpropInput", 0.5)),
    )
    assert kernel_seconds(measured, two) == [0.5, 2.5]
    unnamed = dataclasses.replace(measured, gradient_kernel_seconds=(("renamed", 3.0),))
    assert kernel_seconds(unnamed, two) == [1.5, 1.5]


def _products_ahead(block, jit_compile=False, scope="block"):
    """`Execution.products_ahead` of two `block`s of a 64-wide layer in a `tf.function`, under
    the name `scope`, by op type and the type of the tensor each op's product reads; and the
    plain peaks of `tf.gradients` and of `gradients`, which keeps its products in order."""
    found = {}

    @tf.function(jit_compile=jit_compile, autograph=False)
    def step(x, *weights):
        h = x
        with tf.name_scope(scope):
            for w in weights:
                h = block(h @ w)
        view = ForwardView.build([tf.reduce_sum(h * h)], list(weights))
        ahead = execution_of(view).products_ahead
        found["ahead"] = sorted((op.type, t.op.type) for op, t in ahead.items())
        plan = msg.Plan(view, [()], "plain")
        found["peaks"] = plan.plain_peak_bytes, plan.fallback_peak_bytes
        return h

    step.get_concrete_function(
        *[tf.TensorSpec(shape, tf.float32) for shape in ([32, 64],) + ([64, 64],) * 2]
    )
    return found["ahead"], found["peaks"]


def test_a_softmax_of_scaled_logits_is_multiplied_by_the_scale_in_plain_backprops_forward_pass():
    """`(g * softmax) * scale` becomes `g * (softmax * scale)`, held from the forward pass on
    beside the softmax, which backprop reads too: one more tensor in `tf.gradients`' peak
    than in that of `gradients`, which keeps the order. Not where the softmax's name sorts
    after the gradients' (`gradients/...`), whose product the optimizers then take first."""
    ahead, (plain, in_order) = _products_ahead(lambda h: tf.nn.softmax(h * 0.125))
    assert ahead == [("Softmax", "Softmax")] * 2
    assert plain - in_order == 32 * 64 * 4
    later, (plain, in_order) = _products_ahead(lambda h: tf.nn.softmax(h * 0.125), scope="z")
    assert later == [] and plain == in_order


def test_a_forward_tensor_multiplied_last_is_held_as_a_product_only_where_backprop_reads_it_too():
    """`(h * 0.5) * tanh(h)`: the gradient reaching `h * 0.5` ends in `g * tanh(h)`, whose
    `tanh(h) * 0.5` is held beside `tanh(h)`, which its own gradient reads. GELU's
    `(0.5 * h) * erfc(-h / sqrt 2)`: nothing else reads the erfc, which the product replaces.
    A factor with a gradient of its own (a learned scale), or no smaller one, is left alone,
    as is everything under XLA."""
    assert _products_ahead(lambda h: (h * 0.5) * tf.tanh(h))[0] == [("Mul", "Tanh")] * 2
    assert _products_ahead(lambda h: tf.nn.gelu(h, approximate=False))[0] == []
    assert _products_ahead(lambda h: tf.nn.softmax(h * tf.tanh(h[:1])))[0] == []
    assert _products_ahead(lambda h: (h * tf.ones([32, 64])) * tf.tanh(h))[0] == []
    xla, (plain, in_order) = _products_ahead(lambda h: tf.nn.softmax(h * 0.125), jit_compile=True)
    assert xla == [] and plain == in_order
