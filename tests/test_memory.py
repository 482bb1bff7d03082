"""Peak memory of checkpointed gradients, in units of 1 MB tensors (250,000 float32).

Each measurement runs a warm-up step, then three measured steps in a fresh Session with its
own single inter-op thread (`use_per_session_threads`: otherwise the first Session of the
process fixes the thread count for every later one). It reports the smallest of their peaks
minus what was resident before the step (`memory_saving_gradients.profiling.peak_memory`):
TensorFlow's executor may order ready ops differently from one step to the next, which can
keep one more tensor alive. The chains start from a variable, so constant folding cannot
precompute them.

On a chain of n tanh ops, plain backprop holds every tanh output: n MB. With a checkpoint
every k ops, it holds the n/k - 1 checkpoints plus one segment of k recomputed outputs, less
two that TensorFlow's kernels compute in place of a buffer they no longer need:
n/k + k - 2 MB. The 'memory' strategy instead shrinks segments towards the end, so that the
checkpoints before each segment plus the segment itself stay within the smallest possible
peak P: segments of P, P - 1, ..., 1 outputs cover P (P + 1) / 2 ops, so P is the least
integer with P (P + 1) / 2 >= n, about sqrt(2 n); TensorFlow then holds P MB plus at most
one 1 MB gradient buffer, depending on the order it runs ready ops in.
"""

import json
import math
import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import TimeRatio, peak_memory, turn_ratios
from tests.helpers import (
    assert_same_gradients,
    one_level,
    original_of,
    recomputed_copies,
    run_python,
)

tf1 = tf.compat.v1
MB = 250_000
#: Allocator rounding and small buffers (shapes, reductions) on top of the whole tensors.
SLACK_MB = 0.7


def chain(n: int, residual: bool = False):
    """A variable of 1 MB followed by n tanh ops (h + tanh(h) when residual)."""
    start = tf.Variable(tf.ones([MB]), name="start")
    nodes = [start.read_value()]
    for _ in range(n):
        h = tf.tanh(nodes[-1])
        nodes.append(h + nodes[-1] if residual else h)
    return start, nodes


def step_peak_mb(build) -> float:
    """Peak MB of one step fetching what `build()` returns, in a fresh graph and Session."""
    with tf.Graph().as_default() as graph:
        fetch = build()
        init = tf1.global_variables_initializer()
    config = tf1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
    with tf1.Session(graph=graph, config=config) as session:
        session.run(init)
        session.run(fetch)
        return min(peak_memory(lambda: session.run(fetch), warmup=0) for _ in range(3)) / 1e6


def chain_gradient_peak_mb(n: int, checkpoints, residual: bool = False) -> float:
    def build():
        start, nodes = chain(n, residual)
        y = tf.reduce_sum(nodes[-1])
        if checkpoints is None:
            return tf1.gradients(y, start)[0]
        chosen = checkpoints(nodes) if isinstance(checkpoints, types.FunctionType) else checkpoints
        return msg.gradients(y, start, checkpoints=chosen)[0]

    return step_peak_mb(build)


@pytest.mark.tf2_only
def test_the_cpu_allocators_statistics_count_requests_from_256_kib():
    """What every CPU measurement here reads: TensorFlow's CPU allocator statistics leave out
    requests under 256 KiB (served apart from the pool they count), so a step of two such
    tensors reads as needing nothing, and one of two tensors of 256 KiB as 512 KiB."""
    peaks = {}
    for elements in (2**16 - 1, 2**16):
        values = tf.Variable(tf.ones([elements]))
        step = tf.function(lambda values=values: tf.reduce_sum(tf.exp(values) * tf.sin(values)))
        peaks[elements] = peak_memory(step)
    assert peaks == {2**16 - 1: 0, 2**16: 2 * 2**18}, peaks


def test_time_ratios_divide_each_turn_by_the_references_time_in_that_turn():
    """A step twice as slow as plain in every turn reads 2.0, however the machine's speed
    moves between turns: the ratio of medians of these times reads 1.5."""
    times = {"plain": [1.0, 1.0, 4.0, 4.0, 4.0], "twice": [2.0, 2.0, 8.0, 8.0, 8.0]}
    ratios = turn_ratios(times, "plain")
    assert ratios["plain"] == TimeRatio(1.0, 1.0, 1.0)
    assert ratios["twice"] == TimeRatio(2.0, 2.0, 2.0)
    spread = turn_ratios({"plain": [1.0] * 5, "other": [1.0, 1.1, 1.2, 1.3, 1.4]}, "plain")
    assert spread["other"].median == pytest.approx(1.2)
    assert spread["other"].lower_quartile == pytest.approx(1.05)
    assert spread["other"].upper_quartile == pytest.approx(1.35)
    with pytest.raises(ValueError, match="'fast' is not one of the steps"):
        turn_ratios(times, "fast")
    with pytest.raises(ValueError, match=r"\['short'\] have not as many"):
        turn_ratios({**times, "short": [1.0]}, "plain")


def test_step_time_ratios_take_the_steps_in_turns_after_untimed_ones():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("plain", "other")}
    ratios = msg.profiling.step_time_ratios(steps, "plain", turns=3, warmup=2)
    assert calls == ["plain", "other"] * 5
    assert set(ratios) == {"plain", "other"} and ratios["plain"].median == 1.0
    with pytest.raises(ValueError, match="reference 'base' is not one of the steps"):
        msg.profiling.step_time_ratios(steps, "base")
    with pytest.raises(ValueError, match="turns must be at least 1"):
        msg.profiling.step_time_ratios(steps, "plain", turns=0)


@pytest.mark.parametrize("n", [5, 10])
def test_plain_chain_holds_every_activation(n):
    assert chain_gradient_peak_mb(n, None) == pytest.approx(n, abs=SLACK_MB)


@pytest.mark.parametrize("residual", [False, True], ids=["chain", "residual"])
@pytest.mark.parametrize(("n", "k"), [(16, 4), (20, 5), (30, 3), (30, 10), (49, 7)])
def test_manual_checkpoints_every_k(n, k, residual):
    peak = chain_gradient_peak_mb(n, lambda nodes: nodes[k:n:k], residual)
    assert peak == pytest.approx(n / k + k - 2, abs=SLACK_MB)


def shrinking_segments_peak(n: int) -> int:
    """The least P with P (P + 1) / 2 >= n."""
    return math.ceil((math.sqrt(8 * n + 1) - 1) / 2)


@pytest.mark.parametrize("residual", [False, True], ids=["chain", "residual"])
@pytest.mark.parametrize("n", [16, 36, 100])
def test_one_level_cuts_keep_about_sqrt_2n(n, residual):
    peak = chain_gradient_peak_mb(n, lambda nodes: one_level, residual)
    assert (
        shrinking_segments_peak(n) - SLACK_MB <= peak <= shrinking_segments_peak(n) + 1 + SLACK_MB
    )


@pytest.mark.parametrize("residual", [False, True], ids=["chain", "residual"])
@pytest.mark.parametrize("n", [36, 100])
def test_memory_strategy_nests_below_one_level(n, residual):
    """Below one level's sqrt(2n), cuts nested in segments hold fewer tensors still."""
    peak = chain_gradient_peak_mb(n, "memory", residual)
    assert peak <= shrinking_segments_peak(n) - 2 + SLACK_MB


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_memory_budget_fits_and_recomputes_less_than_memory(fraction):
    """A budget keeps the predicted peak within its fraction of plain backprop's (n MB) and
    recomputes least for it: at a quarter, about 'memory''s own peak (about sqrt(2n)); at a
    half, a long final segment that is not recomputed at all."""
    n = 40
    peak = chain_gradient_peak_mb(n, msg.MemoryBudget(fraction))
    assert peak <= fraction * n + SLACK_MB

    def recomputed_tanh(checkpoints) -> int:
        with tf.Graph().as_default() as graph:
            start, nodes = chain(n)
            msg.gradients(tf.reduce_sum(nodes[-1]), start, checkpoints=checkpoints)
        return sum(op.type == "Tanh" for op in recomputed_copies(graph))

    budget, memory = recomputed_tanh(msg.MemoryBudget(fraction)), recomputed_tanh("memory")
    assert budget <= memory
    if fraction == 0.5:
        assert peak > chain_gradient_peak_mb(n, "memory") + 1
        assert budget < 0.8 * memory


@pytest.mark.parametrize("fraction", [0.1, 0.15])
def test_budgets_below_one_level_nest_and_are_met(fraction):
    """One level of cuts holds about sqrt(2n) = 11 MB on a 64-layer chain; a budget below that
    recomputes segments within segments, within the budget, with exact gradients."""
    n = 64
    with tf.Graph().as_default():
        start, nodes = chain(n)
        plan = msg.plan(tf.reduce_sum(nodes[-1]), start, checkpoints=msg.MemoryBudget(fraction))
    assert plan.nested
    peak = chain_gradient_peak_mb(n, msg.MemoryBudget(fraction))
    assert peak <= max(fraction * n, plan.peak_bytes / MB) + SLACK_MB
    assert peak < chain_gradient_peak_mb(n, lambda nodes: one_level) - 2


@pytest.mark.parametrize("fraction", [0.5, 0.25, 0.12])
def test_byte_budgets_are_met_with_exact_gradients(fraction):
    """`MemoryBudget(bytes=...)` at a half, a quarter and an eighth of plain backprop's
    measured peak on a 64-layer chain (the last two below one level's least, so nested): the
    measured peak stays within the bytes given, and the gradients are tf.gradients'."""
    n = 64
    plain_bytes = chain_gradient_peak_mb(n, None) * 1e6
    budget = msg.MemoryBudget(bytes=int(fraction * plain_bytes))
    assert chain_gradient_peak_mb(n, budget) <= budget.bytes / 1e6 + SLACK_MB
    with tf.Graph().as_default():
        start, nodes = chain(n)
        loss = tf.reduce_sum(nodes[-1] * np.linspace(0.5, 1.5, MB).astype("f4"))
        reference = tf1.gradients(loss, start)
        got = msg.gradients(loss, start, checkpoints=budget)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            want, have = session.run((reference, got))
    np.testing.assert_allclose(have[0], want[0], rtol=1e-6)


def test_collection_checkpoints_save_like_a_list():
    def every_five(nodes):
        for node in nodes[5:25:5]:
            msg.add_checkpoint(node)
        return "collection"

    assert chain_gradient_peak_mb(25, every_five) == pytest.approx(8, abs=SLACK_MB)


def test_slope_of_peak_against_depth():
    """Plain memory grows linearly with depth; 'memory' grows like its square root."""
    depths = np.array([16, 36, 64, 144, 256])
    plain = [chain_gradient_peak_mb(n, None) for n in depths]
    memory = [chain_gradient_peak_mb(n, "memory") for n in depths]
    plain_slope = np.polyfit(np.log(depths), np.log(plain), 1)[0]
    memory_slope = np.polyfit(np.log(depths), np.log(memory), 1)[0]
    assert plain_slope > 0.85
    assert memory_slope < 0.6


def scalar_weighted_chain(n: int):
    """h <- tanh(w_i * h) on a 1 MB activation, with one scalar variable per layer."""
    h = tf.Variable(tf.ones([MB]), trainable=False).read_value()
    for i in range(n):
        h = tf.tanh(tf.Variable(0.9, name=f"w{i}") * h)
    return tf.reduce_sum(h)


def test_patched_optimizer_minimize_saves_memory():
    n = 36

    def train_step():
        return tf1.train.GradientDescentOptimizer(0.01).minimize(scalar_weighted_chain(n))

    def with_patch():
        with msg.patched("memory"):
            return train_step()

    # Each weight's gradient sums a 1 MB product (upstream gradient times activation), so the
    # optimizer step holds a few MB of gradient temporaries on top of the activations. Plain
    # TensorFlow's peak here is n + 2 MB in a fresh process, one MB less after some of the other
    # tests ran in the same process (measured; it is TensorFlow's, not checkpointing's).
    assert n + 1 - SLACK_MB <= step_peak_mb(train_step) <= n + 2 + SLACK_MB
    # One level of cuts would hold sqrt(2n) = 8 MB and those gradient temporaries; 'memory'
    # nests below that.
    assert step_peak_mb(with_patch) <= shrinking_segments_peak(n) + SLACK_MB


def dense_bias_chain_peak(n: int, checkpoints) -> float:
    """Peak of a chain of n tanh(h @ w + b) layers, in activations (batch 2048, width 128).

    Each layer's weight and bias gradients read its input activation and are ready as soon as
    backprop passes the layer, but nothing else waits for them: with one inter-op thread the
    executor may leave them queued until the end of the backward pass, holding every
    activation they read. Recomputation must wait for them, or it saves nothing.
    """
    batch, width = 2048, 128

    def build():
        rng = np.random.default_rng(0)
        weights = [
            tf.Variable(rng.standard_normal((width, width)).astype("f4") * 0.1) for _ in range(n)
        ]
        biases = [tf.Variable(np.zeros(width, "f4")) for _ in range(n)]
        h = tf.Variable(rng.standard_normal((batch, width)).astype("f4"), trainable=False)
        h = h.read_value()
        for w, b in zip(weights, biases, strict=True):
            h = tf.tanh(tf.nn.bias_add(tf.matmul(h, w), b))
        loss = tf.reduce_sum(h * h)
        variables = [*weights, *biases]
        if checkpoints is None:
            grads = tf1.gradients(loss, variables)
        else:
            grads = msg.gradients(loss, variables, checkpoints=checkpoints)
        return tf.group([v.assign_sub(0.01 * g) for v, g in zip(variables, grads, strict=True)])

    return step_peak_mb(build) / (batch * width * 4 / 1e6)


def test_recomputation_waits_for_the_weight_gradients_of_the_segment_before():
    n = 32
    plain = dense_bias_chain_peak(n, None)
    checkpointed = dense_bias_chain_peak(n, "memory")
    assert plain >= n
    # Measured: plain 37, checkpointed 10 (33 when recomputation waits for the incoming
    # gradients only); the 3 on top of the activations are gradient temporaries.
    assert checkpointed <= shrinking_segments_peak(n) + 3, (checkpointed, plain)


def two_branch_peak_mb(n: int, k: int, checkpointed: bool) -> float:
    """Two independent chains of n tanh ops joined at the end by a product (so backprop needs
    both forward passes), checkpointed at their k-th outputs."""

    def build():
        starts = [tf.Variable(tf.ones([MB]) * scale) for scale in (1.0, 0.5)]
        branches = [[start.read_value()] for start in starts]
        for _ in range(n):
            for branch in branches:
                branch.append(tf.tanh(branch[-1]))
        y = tf.reduce_sum(branches[0][-1] * branches[1][-1])
        if not checkpointed:
            return tf1.gradients(y, starts)
        return msg.gradients(y, starts, checkpoints=[branch[k] for branch in branches])

    return step_peak_mb(build)


def test_independent_branches_are_recomputed_one_after_the_other():
    """Segments of one level that do not depend on each other get steps of their own; each
    step starts once the steps before it are done. The forward pass ends holding both
    branches' last n - k outputs and both checkpoints; recomputing the branches one at a time
    never needs more."""
    n, k = 12, 8
    plain = two_branch_peak_mb(n, k, checkpointed=False)
    checkpointed = two_branch_peak_mb(n, k, checkpointed=True)
    assert plain >= 2 * n - 2  # both branches at once; more where the allocator rounds up
    assert checkpointed <= 2 * (n - k) + 2 + SLACK_MB


def test_custom_gradients_closing_over_forward_tensors_free_them():
    """`tf.nn.silu` is a `tf.custom_gradient` whose gradient reads the forward tensor it was
    called with: differentiating a recomputed copy read the original, so every layer's input
    stayed alive (32 layers: 34.4 MB under 'memory', plain's own peak; 10.2 now) (NOTE
    [gradients closing over forward tensors])."""
    n = 32

    def build(checkpoints):
        start = tf.Variable(tf.ones([MB]) * 0.5)
        h = start.read_value()
        for _ in range(n):
            h = tf.nn.silu(h)
        y = tf.reduce_sum(h)
        if checkpoints is None:
            return tf1.gradients(y, start)[0]
        return msg.gradients(y, start, checkpoints=checkpoints)[0]

    plain = step_peak_mb(lambda: build(None))
    checkpointed = step_peak_mb(lambda: build("memory"))
    assert plain > n
    assert checkpointed <= shrinking_segments_peak(n) + 3 + SLACK_MB


@pytest.mark.tf2_only
def test_custom_gradients_of_nested_steps_read_the_copies_around_them():
    """Inside a nested step, a `tf.custom_gradient` closes over the boundary its inner
    schedule starts from, which is no op of the inner view: it must read the outer step's
    copy (through its gate), not the forward tensor, or each nested boundary stays alive from
    the forward pass (sixteen silu layers of 2048 x 512: 44 MiB measured where 37 were
    predicted; 35 now)."""
    weights = [
        tf.Variable(tf.random.stateless_normal([256, 256], [i, 0]) * 0.06) for i in range(16)
    ]
    x = tf.random.stateless_normal([512, 256], [99, 0])
    seen = {}

    @tf.function
    def step():
        h = x
        for w in weights:
            h = tf.nn.silu(h @ w)
        loss = tf.reduce_sum(h * h)
        plan = msg.plan(loss, weights, checkpoints="memory")
        seen.update(nested={t.op.name for level in plan.nested for t in level})
        seen.update(peak=plan.peak_bytes)
        gradients = msg.gradients(loss, weights, checkpoints="memory")
        return [tf.reduce_sum(g) for g in gradients]

    step()
    graph = step.get_concrete_function().graph
    nested = [graph.get_operation_by_name(name) for name in seen["nested"]]
    assert [op for op in nested if op.type == "MatMul"]  # what silu closes over
    for op in nested:
        readers = [c.name for c in op.outputs[0].consumers() if c.name.startswith("gradients")]
        assert not readers, (op.name, readers)
    measured = min(peak_memory(step) for _ in range(3))
    assert measured <= 1.1 * seen["peak"], (measured, seen["peak"])


def scaled_attention_step(checkpoints, scope="block"):
    """Four blocks of attention scaling its logits after the product of queries and keys, as
    `keras.ops.dot_product_attention` does (batch 8, 256 tokens, width 32), under the name
    `scope`, differentiated with `checkpoints` (None: `tf.gradients`) in a `tf.function`.
    Returns the step, the predicted peak of what runs (`Plan.step_peak_bytes`;
    `Plan.plain_peak_bytes` for `tf.gradients`), and the Mul ops that
    TensorFlow's optimizers left multiplying a softmax by a constant: a product computed in
    the forward pass (NOTE [products reassociated ahead] in `ordering.py`)."""
    weights = [tf.Variable(tf.random.stateless_normal([32, 96], [i, 0]) * 0.1) for i in range(4)]
    x = tf.random.stateless_normal([8, 256, 32], [99, 0])
    seen = {}

    @tf.function
    def step():
        h = x
        with tf.name_scope(scope):
            for w in weights:
                q, k, v = tf.split(tf.einsum("bsd,de->bse", h, w), 3, axis=-1)
                logits = tf.einsum("bqd,bkd->bqk", q, k) * 32**-0.5
                h = h + tf.einsum("bqk,bkd->bqd", tf.nn.softmax(logits), v)
        loss = tf.reduce_sum(h * h)
        plan = msg.plan(loss, weights, checkpoints=checkpoints or "memory")
        if checkpoints is None:
            seen.update(peak=plan.plain_peak_bytes)
            return tf.gradients(loss, weights)
        seen.update(peak=plan.step_peak_bytes)
        return msg.gradients(loss, weights, checkpoints=checkpoints)

    ahead = softmaxes_multiplied_ahead(step)  # traces the step, which plans it
    return step, seen["peak"], ahead


def softmaxes_multiplied_ahead(run) -> list[str]:
    """The Mul ops that TensorFlow's optimizers left multiplying a softmax by a constant in
    the functions the first call of `run` runs: products computed in the forward pass."""
    from tensorflow.python.eager import context

    context.context().enable_run_metadata()
    try:
        run()
        metadata = context.context().export_run_metadata()
    finally:
        context.context().disable_run_metadata()
    ahead = []
    for function in metadata.function_graphs:
        graph = function.post_optimization_graph
        nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
        types = {n.name: n.op for n in nodes}
        for node in nodes:
            read = [types.get(name.lstrip("^").split(":")[0]) for name in node.input]
            if node.op == "Mul" and "Const" in read and {"Softmax", "_MklSoftmax"} & set(read):
                ahead.append(node.name)
    return ahead


def scaled_attention_peaks(
    checkpoints: str | None, threads: int, scope: str = "block"
) -> tuple[int, int, int, list[str]]:
    """Measured (least of three steps, on `threads` inter-op threads), requested (the largest
    sum of the bytes its live tensors asked for, profiled: the allocator's peak adds its
    rounding) and predicted peak of `scaled_attention_step(checkpoints, scope)`, and its
    products run ahead."""
    from memory_saving_gradients.cli.suites import trace

    tf.config.threading.set_inter_op_parallelism_threads(threads)
    step, predicted, ahead = scaled_attention_step(checkpoints, scope)
    measured = min(peak_memory(step) for _ in range(3))
    return measured, trace.profiled(step).requested_peak, predicted, ahead


_SCALED_ATTENTION_PEAKS = """
import json
import sys
from tests.test_memory import scaled_attention_peaks
print(json.dumps(scaled_attention_peaks(*json.loads(sys.argv[1]))))
"""


@pytest.mark.tf2_only
def test_tensorflow_multiplies_a_softmax_by_its_scale_ahead_of_backprop():
    """The premise of the test below: plain backprop's `(g * softmax) * scale` becomes
    `g * (softmax * scale)` in TensorFlow's optimizers, one per block."""
    _, _, ahead = scaled_attention_step(None)
    assert len(ahead) == 4, ahead


@pytest.mark.tf2_only
@pytest.mark.parametrize("checkpoints", ["speed", "memory"])
def test_a_scaled_softmax_is_not_multiplied_ahead_and_its_steps_are_as_predicted(checkpoints):
    """No product of a softmax and its scale runs ahead of backprop (it held one more
    attention matrix per block: 'speed', which falls back to plain backprop here, measured
    23.75 MiB where 16.0 were predicted; 17.5 before the softmax's gradient was sliced; now
    16.0 measured, 14.5 requested, 14.3 predicted), and a nested step waits for the gradient
    reading its outer copy of the softmax before recomputing it ('memory': 10.25 MiB where
    7.5 were predicted; 8.5; now 7.5 measured, 6.25 requested, 6.0 predicted: the allocator
    hands 2 MiB requests blocks of up to twice that). One inter-op thread, whose executor ran
    that step first."""
    out = run_python("-c", _SCALED_ATTENTION_PEAKS, json.dumps([checkpoints, 1]))
    measured, requested, predicted, ahead = json.loads(out.strip().splitlines()[-1])
    assert not ahead
    assert requested <= 1.1 * predicted, (requested, predicted)
    assert measured <= 1.3 * predicted, (measured, predicted)


@pytest.mark.tf2_only
@pytest.mark.parametrize("scope, products_ahead", [("block", 4), ("z", 0)])
def test_plain_backprops_products_moved_ahead_are_predicted(scope, products_ahead):
    """`tf.gradients` of the four blocks holds each block's `softmax * scale` from the
    forward pass on where the softmax's name sorts before the gradients' (`block/...`), and
    its predicted peak counts them (`Execution.products_ahead`): 24.0 MiB predicted,
    25.25-27.0 measured on two inter-op threads, where 16.0 were predicted before. Under `z/`
    the optimizers multiply the gradient by the scale first, and nothing is held: 16.0
    predicted, 17.75 measured."""
    out = run_python("-c", _SCALED_ATTENTION_PEAKS, json.dumps([None, 2, scope]))
    measured, _, predicted, ahead = json.loads(out.strip().splitlines()[-1])
    assert len(ahead) == products_ahead, ahead
    assert abs(predicted / measured - 1) <= 0.15, (measured, predicted)


def dual_chain_peak_mb(checkpointed: bool) -> float:
    """The original library's "dual chain rewrite" (its memory_test.py), in its Session
    configuration: two chains of 5 ops from constants, `y = a[-1] + b[-1]`, differentiated
    against both starts (checkpoints a[2], b[2]), the gradients' ops fetched. b's forward pass
    waits for a's gradient: see the test below for why."""

    def build():
        a, b = [tf.ones([MB], name="a0")], [tf.ones([MB], name="b0")]
        for _ in range(4):
            a.append(tf.tanh(a[-1]))
            b.append(tf.tanh(b[-1]))
        y = a[-1] + b[-1]
        if checkpointed:
            grads = msg.gradients(y, [a[0], b[0]], checkpoints=[a[2], b[2]])
        else:
            grads = tf1.gradients(y, [a[0], b[0]])
        return [g.op.name for g in grads]

    with tf.Graph().as_default() as built:
        fetch_names = build()
    graph_def = built.as_graph_def()
    next(node for node in graph_def.node if node.name == "b0").input.append("^" + fetch_names[0])
    with tf.Graph().as_default() as graph:
        tf1.import_graph_def(graph_def, name="")
    config = tf1.ConfigProto(
        graph_options=tf1.GraphOptions(
            optimizer_options=tf1.OptimizerOptions(opt_level=tf1.OptimizerOptions.L0),
            place_pruned_graph=True,
        ),
        inter_op_parallelism_threads=1,
        use_per_session_threads=True,
    )
    config.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    fetch = [graph.get_operation_by_name(name) for name in fetch_names]
    with tf1.Session(graph=graph, config=config) as session:
        return peak_memory(lambda: session.run(fetch)) / 1e6


def test_dual_chain_of_the_original_library_holds_less_than_plain():
    """Backprop reaching chain a before b's forward pass runs: plain holds one chain at a time.
    The step recomputing a[1] waited for b's gradients too, so a's checkpoint and gradient
    stayed alive through b's forward pass (NOTE [gates]); with b's forward pass made to wait
    for a's gradient, that wait is a cycle."""
    # Which of two independent chains runs first is the executor's choice: it runs the ready
    # roots of the graph in order, and one more Const root after the seed of backprop (which
    # the rewrite's shape constants are) makes plain itself run both forward passes first now
    # and then. The control edge on b0 fixes that order for both graphs.
    plain = dual_chain_peak_mb(False)
    checkpointed = dual_chain_peak_mb(True)
    assert plain == pytest.approx(5, abs=SLACK_MB)
    assert checkpointed <= plain - 1 + SLACK_MB


def recomputed_data_gradients(
    concatenated: bool, size: int = 8, channels: int = 4
) -> dict[str, bool]:
    """For a chain of a ReLU then four convolutions with ReLUs (`channels` wide, on
    `size`x`size` images), each reading the ReLU before it or a concatenation of it with
    itself, checkpointed in the middle: whether each recomputed convolution's input gradient
    waits for a filter gradient, by name."""
    with tf.Graph().as_default() as graph:
        start = tf.Variable(tf.ones([2, size, size, channels]))
        read_channels = 2 * channels if concatenated else channels
        kernels = [tf.Variable(tf.ones([3, 3, read_channels, channels]) * 0.1) for _ in range(4)]
        h, hidden = tf.nn.relu(start.read_value()), []
        for kernel in kernels:
            read = tf.concat([h, h], -1) if concatenated else h
            h = tf.nn.relu(tf.nn.conv2d(read, kernel, 1, "SAME"))
            hidden.append(h)
        msg.gradients(tf.reduce_sum(h), [start, *kernels], checkpoints=[hidden[1]])
    return {
        op.name: any(c.type == "Conv2DBackpropFilter" for c in op.control_inputs)
        for op in graph.get_operations()
        if op.type == "Conv2DBackpropInput" and "/recompute_" in op.name
    }


def test_weight_gradients_run_first_where_they_free_the_activation():
    """NOTE [weight gradients first] in _src/rewriting/ordering.py: a recomputed convolution's
    filter gradient frees the concatenation it reads before the input gradient allocates
    its own; the gradient of a ReLU reads its output, which is held for that anyway, so
    there both gradients are left free to run side by side."""
    ordered = recomputed_data_gradients(concatenated=True)
    assert ordered and all(ordered.values()), ordered
    free = recomputed_data_gradients(concatenated=False)
    assert free and not any(free.values()), free


def test_weight_gradients_run_first_where_they_outweigh_the_data_gradient():
    """NOTE [weight gradients first]: only a filter gradient smaller than the input gradient
    beside it is left free to lag; with many channels on a small image it is the larger, and
    runs first even where a ReLU's gradient holds the activation."""
    ordered = recomputed_data_gradients(concatenated=False, size=2, channels=64)
    assert ordered and all(ordered.values()), ordered


def test_weight_gradients_run_first_where_branches_sum_their_data_gradients():
    """NOTE [weight gradients first]: two branches after the checkpoint read one ReLU, whose
    gradient holds it; but their convolutions' input gradients are summed, so one run early
    would wait for the other branch's, and the filter gradients still run first."""
    with tf.Graph().as_default() as graph:
        start = tf.Variable(tf.ones([8, 32, 32, 4]))
        kernels = [tf.Variable(tf.ones([3, 3, 4, 4]) * 0.1) for _ in range(8)]
        h = tf.nn.relu(start.read_value())
        for kernel in kernels[:4]:
            h = tf.nn.relu(tf.nn.conv2d(h, kernel, 1, "SAME"))
        kept = h
        h = tf.nn.relu(tf.nn.conv2d(h, kernels[4], 1, "SAME"))
        branches = [tf.nn.relu(tf.nn.conv2d(h, kernel, 1, "SAME")) for kernel in kernels[5:7]]
        h = tf.nn.relu(tf.nn.conv2d(branches[0] + branches[1], kernels[7], 1, "SAME"))
        msg.gradients(tf.reduce_sum(h), [start, *kernels], checkpoints=[kept])
    branch_data_gradients = [
        op
        for op in graph.get_operations()
        if op.type == "Conv2DBackpropInput"
        and ("Conv2D_5_grad" in op.name or "Conv2D_6_grad" in op.name)
    ]
    assert len(branch_data_gradients) == 2
    for op in branch_data_gradients:
        assert any(c.type == "Conv2DBackpropFilter" for c in op.control_inputs), op.name


def test_matrix_weight_gradients_run_first():
    """NOTE [weight gradients first]: a tanh's gradient reads its output, which the matrix
    gradient of the layer after it reads too; left free, the matrix gradients of a chain fall
    behind the data gradients', each holding its activation, so they run first."""
    with tf.Graph().as_default() as graph:
        start = tf.Variable(tf.ones([8, 64]))
        weights = [tf.Variable(tf.ones([64, 64]) * 0.01) for _ in range(4)]
        h, hidden = tf.tanh(start.read_value()), []
        for weight in weights:
            h = tf.tanh(h @ weight)
            hidden.append(h)
        msg.gradients(tf.reduce_sum(h), [start, *weights], checkpoints=[hidden[1]])
    data_gradients = [
        op
        for op in graph.get_operations()
        if op.type == "MatMul" and "/recompute_" in op.name and op.get_attr("transpose_b")
    ]
    assert data_gradients
    for op in data_gradients:
        assert any(c.type == "MatMul" for c in op.control_inputs), op.name


#: `kernel_cast_peaks`' chain: matmuls of 16 rows reading bfloat16 copies of 2 MiB.
CAST_DEPTH, CAST_WIDTH = 24, 1024
CAST_BYTES = CAST_WIDTH * CAST_WIDTH * 2


def cast_chain(weights):
    """tanh(h @ cast(w)) for each kernel, as a Keras layer under a mixed-precision policy
    computes it; returns the loss and every other output, to keep."""
    h, outputs = tf.cast(tf.ones([16, CAST_WIDTH]), tf.bfloat16), []
    for w in weights:
        h = tf.tanh(h @ tf.cast(w, tf.bfloat16))
        outputs.append(h)
    return tf.reduce_sum(tf.cast(h, tf.float32)), outputs[1:-1:2]


def cast_kernel():
    return tf1.random_normal_initializer(stddev=0.03)([CAST_WIDTH, CAST_WIDTH])


def kernel_cast_peaks(in_function: bool) -> tuple[int, int]:
    """Measured (least of three steps, one inter-op thread) and predicted peak of checkpointed
    backprop through `cast_chain`: in a tf.function, or in a Session."""
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if in_function:
        weights = [tf.Variable(cast_kernel()) for _ in range(CAST_DEPTH)]
        plans = []

        @tf.function
        def step():
            loss, checkpoints = cast_chain(weights)
            plans.append(msg.plan(loss, weights, checkpoints=checkpoints))
            grads = msg.gradients(loss, weights, checkpoints=checkpoints)
            return [tf.reduce_sum(g) for g in grads]

        step()
        return min(peak_memory(step) for _ in range(3)), plans[0].peak_bytes
    with tf.Graph().as_default() as graph:
        weights = [tf1.get_variable(f"w{i}", initializer=cast_kernel()) for i in range(CAST_DEPTH)]
        loss, checkpoints = cast_chain(weights)
        predicted = msg.plan(loss, weights, checkpoints=checkpoints).peak_bytes
        grads = msg.gradients(loss, weights, checkpoints=checkpoints)
        fetch = [tf.reduce_sum(g) for g in grads]
        init = tf1.global_variables_initializer()
    config = tf1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
    with tf1.Session(graph=graph, config=config) as session:
        session.run(init)
        session.run(fetch)
        peak = min(peak_memory(lambda: session.run(fetch), warmup=0) for _ in range(3))
    return peak, predicted


_KERNEL_CAST_PEAKS = """
import json
import sys
if sys.argv[1] == "session":
    import tests.conftest  # TF1 behaviour where the suite's TF1 slice runs
from tests.test_memory import kernel_cast_peaks
print(json.dumps(kernel_cast_peaks(sys.argv[1] == "function")))
"""


@pytest.mark.tf2_only
def test_kernel_casts_wait_for_the_op_before_their_matmul():
    """NOTE [weight ops wait for their readers]: in a function, each kernel's cast waits for
    what the op making its matmul's other input reads (for the first, the input's Fill; then
    each tanh's input), and so does each recomputed copy of it."""
    weights = [tf.Variable(cast_kernel()) for _ in range(4)]

    @tf.function
    def step():
        loss, kept = cast_chain(weights)
        return msg.gradients(loss, weights, checkpoints=kept)

    graph = step.get_concrete_function().graph

    def waits_for_the_op_before_its_matmul(cast: tf.Operation) -> bool:
        (matmul,) = (op for op in cast.outputs[0].consumers() if "_grad/" not in op.name)
        (other,) = (t.op for t in matmul.inputs if t.op is not cast)
        return set(cast.control_inputs) == {t.op for t in other.inputs}

    forward_casts = [
        op for op in graph.get_operations()
        if op.type == "Cast" and op.inputs[0].op.type == "ReadVariableOp"
    ]  # fmt: skip
    assert len(forward_casts) == 4
    assert all(waits_for_the_op_before_its_matmul(op) for op in forward_casts)
    copied_casts = [op for op in recomputed_copies(graph) if original_of(op) in forward_casts]
    assert copied_casts
    assert all(waits_for_the_op_before_its_matmul(op) for op in copied_casts)


def test_kernel_casts_wait_for_their_matmuls_in_functions():
    """Measured in a function: 16-18 MiB, against 26-46 with the casts left free (48 MiB of
    them, made as the step starts, in an order that changes from process to process)."""
    out = run_python("-c", _KERNEL_CAST_PEAKS, "function")
    measured, predicted = json.loads(out.strip().splitlines()[-1])
    assert measured <= 0.5 * CAST_DEPTH * CAST_BYTES, (measured, predicted)


def test_kernel_casts_of_a_session_graph_are_predicted_made_at_the_start():
    """A Session's forward ops are left as built, so the kernel copies are made as the step
    starts, as the simulator predicts: all at once (48.0 MiB), where one thread measured
    28.3-44.3 (the executor runs some matmuls before the last copies are made, in an order
    that changes from process to process: 28.3 in one CI run under TF1 behaviour); predicted
    as made on time: 8.4, which the lower bound tells apart."""
    out = run_python("-c", _KERNEL_CAST_PEAKS, "session")
    measured, predicted = json.loads(out.strip().splitlines()[-1])
    assert predicted >= CAST_DEPTH * CAST_BYTES
    assert 0.5 * predicted <= measured <= 1.05 * predicted, (measured, predicted)


def keras_attention_plain_peaks(name: str) -> tuple[int, int, int, int]:
    """Keras's own `train_on_batch` of a functional model called `name` (two blocks of
    `MultiHeadAttention` without dropout, 4 heads, 128 tokens, batch 8): its measured peak
    (largest of three steps, as the fit suite reads it: with two inter-op threads on a busy
    machine the executor may run a step in an order holding less); the predicted peaks of
    `tf.gradients` and of the plain gradients `gradients` computes, from the plan
    `msg.keras.enable` makes of the same step; and how many softmaxes TensorFlow's
    optimizers multiplied by their scale in its forward pass."""
    import keras

    def model() -> keras.Model:
        keras.utils.set_random_seed(1)
        tokens = keras.Input((128, 64))
        h = tokens
        for _ in range(2):
            a = keras.layers.LayerNormalization()(h)
            h = h + keras.layers.MultiHeadAttention(4, 16)(a, a)
        pooled = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(tokens, keras.layers.Dense(5)(pooled), name=name)

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 128, 64)).astype("f4"), np.zeros(8, "i4")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = model()
    plain.compile(optimizer="sgd", loss=loss)
    ahead = softmaxes_multiplied_ahead(lambda: plain.train_on_batch(x, y))
    measured = max(peak_memory(lambda: plain.train_on_batch(x, y)) for _ in range(3))
    enabled = model()
    msg.keras.enable(enabled, checkpoints="memory")
    enabled.compile(optimizer="sgd", loss=loss)
    enabled.train_on_batch(x, y)
    plan = enabled.checkpoint_plan
    return measured, plan.plain_peak_bytes, plan.fallback_peak_bytes, len(ahead)


_KERAS_ATTENTION_PLAIN_PEAKS = """
import json
import sys
import keras
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(2)
keras.mixed_precision.set_global_policy(sys.argv[1])
from tests.test_memory import keras_attention_plain_peaks
print(json.dumps([keras_attention_plain_peaks(name) for name in sys.argv[2:]]))
"""


@pytest.mark.tf2_only
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_a_keras_models_name_decides_what_its_plain_step_holds_and_the_prediction_follows(
    policy,
):
    """Keras's plain step computes each block's `softmax * scale` in its forward pass where
    the model's name sorts before its gradients' (`gradient_tape/...`: NOTE [products ahead
    in plain backprop]), and plain's predicted peak counts them. In float32, "alpha" measured
    14.5-16.25 MiB, "zeta" 12.5-13.5, predicted 15.0 and 11.0 (11.0 for both before); under
    mixed_float16 (softmax in float32), 14.25-16.5 and 11.5-13.0, predicted 15.2 and 11.2
    (the least of three steps read 12.75 for "alpha" once, on a machine busy with more). The
    rewrite's own plain gradients keep the products in order, whatever the name, and take
    each softmax gradient's sums in slices (NOTE [softmax gradient in slices]): predicted
    below `tf.gradients` by both softmax products, and by a softmax's third tensor where
    the peak is in its gradient ("alpha")."""
    out = run_python("-c", _KERAS_ATTENTION_PLAIN_PEAKS, policy, "alpha", "zeta")
    alpha, zeta = json.loads(out.strip().splitlines()[-1])
    assert (alpha[3], zeta[3]) == (2, 0)
    softmax = 8 * 4 * 128 * 128 * 4
    assert alpha[1] - alpha[2] >= 2 * softmax, alpha
    assert zeta[1] >= zeta[2] == alpha[2], (alpha, zeta)
    assert alpha[0] > zeta[0], (alpha, zeta)
    assert abs(alpha[1] / alpha[0] - 1) <= 0.15, alpha


MiB = 2**20


def _dropped_attention_loss(weights, x, seed, dropout):
    """Attention-like blocks whose probabilities go through `dropout(p, block, seed)`: the
    seed read from a variable, as Keras's seed generators have it (a constant seed would let
    graph optimizers fold the draw into a constant)."""
    h = x
    for block, w in enumerate(weights):
        q = tf.einsum("bhld,de->bhle", h, w)
        p = dropout(tf.nn.softmax(tf.matmul(q, h, transpose_b=True)), block, seed)
        h = h + tf.matmul(p, q)
    return tf.reduce_sum(h * h)


def _dropped_attention_steps(dropout):
    """Plain gradients, 'memory's plan, and that plan holding its masks, of twelve blocks of
    (4, 4, 256, 256) probabilities, each dropped out with a 1 MiB mask."""
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.normal(size=(32, 32)).astype("f4") * 0.2) for _ in range(12)]
    x = tf.constant(rng.normal(size=(4, 4, 256, 32)).astype("f4"))
    seed = tf.Variable([3, 4], dtype=tf.int64)
    plans = {}

    def step(method):
        @tf.function
        def gradients():
            loss = _dropped_attention_loss(weights, x, seed.read_value(), dropout)
            if method == "plain":
                return tf.gradients(loss, weights)
            plan = msg.plan(loss, weights, checkpoints="memory", gradients_held=True)
            if method == "memory":  # on a CPU, 'memory' holds them unless asked
                plan = plan.remaking_outside()
            plans[method] = plan
            return msg.gradients(loss, weights, checkpoints=plan, gradients_held=True)

        return gradients

    return {method: step(method) for method in ("plain", "memory", "held")}, plans


def _stateless_dropout(p, block, seed):
    return tf.nn.experimental.stateless_dropout(p, 0.1, seed=seed + block)


def dropped_attention_peaks() -> dict[str, tuple[float, float, float]]:
    """Measured (least of three steps), requested and predicted peaks in MiB of 'memory''s
    plan of `_dropped_attention_steps` drawing its masks again and holding them."""
    from memory_saving_gradients.cli.suites import trace

    steps, plans = _dropped_attention_steps(_stateless_dropout)
    peaks = {}
    for method in ("memory", "held"):
        step = steps[method]
        step()
        peaks[method] = (
            min(peak_memory(step) for _ in range(3)) / MiB,
            trace.profiled(step).requested_peak / MiB,
            plans[method].peak_bytes / MiB,
        )
    return peaks


_DROPPED_ATTENTION_PEAKS = """
import json
from tests.test_memory import dropped_attention_peaks
print(json.dumps(dropped_attention_peaks()))
"""


@pytest.mark.tf2_only
def test_memory_draws_stateless_dropout_masks_again_rather_than_hold_them():
    """NOTE [masks made again]: a stateless dropout's mask is drawn again from its key and
    counter where its select is recomputed, with the same bits, so backprop holds the masks
    of the blocks it recomputes instead of twelve from the forward pass. 'memory' does so on
    GPUs, and on CPUs where asked (`Plan.remaking_outside`). Peaks are measured in a fresh
    interpreter: in the suite's, the allocator's pool holds fragments earlier tests left
    (the plan drawing again read 24.0 MiB there, holding 25.0)."""
    steps, plans = _dropped_attention_steps(_stateless_dropout)
    got = {method: [g.numpy() for g in step()] for method, step in steps.items()}
    assert_same_gradients(got["plain"], got["memory"])
    assert_same_gradients(got["plain"], got["held"])
    assert len(plans["memory"].remade) == 12 and plans["held"].remade == ()
    assert "draws 12 tensors again" in str(plans["memory"])
    peaks = json.loads(run_python("-c", _DROPPED_ATTENTION_PEAKS).strip().splitlines()[-1])
    (measured, requested, predicted), held = peaks["memory"], peaks["held"]
    assert measured <= held[0] - 2, peaks
    assert predicted <= held[2] - 3, peaks
    assert predicted == pytest.approx(requested, rel=0.15), peaks


@pytest.mark.tf2_only
def test_a_stateful_dropouts_mask_is_held_not_drawn_again():
    """`tf.nn.dropout` draws with a stateful op, which would draw other bits a second time:
    its mask stays held, and the gradients are TensorFlow's."""
    steps, plans = _dropped_attention_steps(
        lambda p, block, seed: tf.nn.dropout(p, 0.1, seed=block)
    )
    tf.random.set_seed(0)
    plain = [g.numpy() for g in steps["plain"]()]
    tf.random.set_seed(0)
    memory = [g.numpy() for g in steps["memory"]()]
    assert_same_gradients(plain, memory)
    assert plans["memory"].remade == ()


@pytest.mark.tf2_only
def test_memory_draws_masks_again_where_a_gpu_draws_them():
    """A draw costs a CPU a pass of its generator per element: there 'memory' holds the
    masks; where the ops are placed on a GPU it draws them again (planned only: soft placement
    would run them on this machine's CPU)."""
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.normal(size=(32, 32)).astype("f4") * 0.2) for _ in range(12)]
    x = tf.constant(rng.normal(size=(4, 4, 256, 32)).astype("f4"))
    seed = tf.Variable([3, 4], dtype=tf.int64)
    remade = {}
    for device in ("/CPU:0", "/GPU:0"):

        @tf.function
        def plan(device=device):
            with tf.device(device):
                loss = _dropped_attention_loss(
                    weights,
                    x,
                    seed.read_value(),
                    _stateless_dropout,
                )
            chosen = msg.plan(loss, weights, checkpoints="memory", gradients_held=True)
            remade[device] = len(chosen.remade)
            return loss

        plan.get_concrete_function()
    assert remade == {"/CPU:0": 0, "/GPU:0": 12}


def test_masks_drawn_again_in_a_session_give_tensorflows_gradients():
    """A `tf.compat.v1` graph run in a Session (under TF1 behaviour too: the seed in a
    reference variable): the masks drawn again have the forward pass's bits, so the
    gradients are `tf.gradients`', and the plan draws each block's mask again."""
    rng = np.random.default_rng(0)
    graph = tf.Graph()
    with graph.as_default():
        weights = [
            tf.compat.v1.Variable(rng.normal(size=(16, 16)).astype("f4") * 0.2) for _ in range(6)
        ]
        x = tf.constant(rng.normal(size=(2, 4, 128, 16)).astype("f4"))  # 128 KiB masks
        seed = tf.compat.v1.Variable([3, 4], dtype=tf.int64)
        loss = _dropped_attention_loss(
            weights,
            x,
            tf.identity(seed),
            _stateless_dropout,
        )
        plan = msg.plan(loss, weights, checkpoints="memory").remaking_outside()
        checkpointed = msg.gradients(loss, weights, checkpoints=plan)
        plain = tf.gradients(loss, weights)
        init = tf.compat.v1.global_variables_initializer()
    assert len(plan.remade) == 6, plan
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        want, have = session.run([plain, checkpointed])
    assert_same_gradients(want, have)
