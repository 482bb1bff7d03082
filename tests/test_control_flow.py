"""Control flow, custom gradients, recompute_grad and stop_gradient in the forward pass.

TF2 control flow (`tf.cond`, `tf.while_loop`) builds one If/While op whose branches and body
are functions; a checkpoint may sit before, after or across such an op, and the op is
recomputed whole or not at all: nothing inside a function body is ever copied.
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src import _tf
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
WIDTH = 8


def numpy(gradients):
    return values(list(gradients))


def layer(h, w):
    return tf.tanh(tf.matmul(h, w))


def cond_model(ws, x, flag):
    """Three layers, a cond choosing between two two-layer branches, three layers."""
    h0 = layer(layer(layer(x, ws[0]), ws[1]), ws[2])
    out = tf.cond(
        flag > 0,
        lambda: layer(layer(h0, ws[3]), ws[4]),
        lambda: tf.sin(tf.matmul(h0, ws[5])),
    )
    h1 = layer(out, ws[6]) + h0  # h0 crosses the cond
    h2 = layer(layer(h1, ws[7]), ws[8])
    return tf.reduce_sum(h2 * h2), {"before": h0, "cond": out, "after": h1, "late": h2}


def while_model(ws, x, steps):
    h0 = layer(layer(x, ws[0]), ws[1])
    _, looped = tf.while_loop(
        lambda i, a: i < steps, lambda i, a: (i + 1, layer(a, ws[2]) + 0.5 * a), (0, h0)
    )
    h1 = layer(looped, ws[3]) * h0  # h0 crosses the loop
    h2 = layer(layer(h1, ws[4]), ws[5])
    return tf.reduce_sum(h2 * h2), {"before": h0, "cond": looped, "after": h1, "late": h2}


PLACES = {
    "before": ["before"],
    "around": ["before", "after"],
    "across": ["cond", "late"],
    "all": ["before", "cond", "after", "late"],
}


def compare_in_session(build, checkpoints):
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws = square_weights(9, WIDTH)
        loss, named = build(ws, x)
        chosen = [named[n] for n in checkpoints] if isinstance(checkpoints, list) else checkpoints
        library_before = {f.signature.name: f for f in graph.as_graph_def().library.function}
        reference = tf1.gradients(loss, ws)
        got = msg.gradients(loss, ws, checkpoints=chosen)
        assert_recomputes(graph)
        library_after = {f.signature.name: f for f in graph.as_graph_def().library.function}
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            feed = {x: np.random.RandomState(1).randn(4, WIDTH).astype(np.float32)}
            values = run_with_nones(session, [reference, got], feed)
    # Function bodies are never edited piecemeal: every forward function is still in the
    # library as it was (differentiating If/While ops may only add functions).
    for name, function in library_before.items():
        assert library_after[name] == function, name
    assert_same_gradients(*values)
    return graph


@pytest.mark.parametrize("flag", [1.0, -1.0], ids=["true_branch", "false_branch"])
@pytest.mark.parametrize("place", [*PLACES, "memory", "speed"])
def test_cond(place, flag):
    checkpoints = PLACES.get(place, place)
    compare_in_session(lambda ws, x: cond_model(ws, x, tf.constant(flag)), checkpoints)


@pytest.mark.parametrize("place", [*PLACES, "memory", "speed"])
def test_while_loop(place):
    compare_in_session(lambda ws, x: while_model(ws, x, 3), PLACES.get(place, place))


def test_checkpoint_inside_a_branch_is_refused_clearly():
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [4, WIDTH])
        ws = square_weights(2, WIDTH)
        inside = []

        def branch():
            inside.append(layer(x, ws[0]))
            return inside[-1]

        loss = tf.reduce_sum(layer(tf.cond(tf.constant(True), branch, lambda: x), ws[1]))
        if tf.compat.v1.control_flow_v2_enabled():  # the branch is a function body
            with pytest.raises(TypeError, match="another graph"):
                msg.gradients(loss, ws, checkpoints=inside)
        else:  # in a TF1 frame, whose ops are never recomputed
            with pytest.raises(msg.NoCheckpointsError, match="no tensor between xs and ys"):
                msg.gradients(loss, ws, checkpoints=inside)


def test_planning_leaves_control_flow_ops_as_they_are():
    """Building a While's registered gradient adds outputs to the forward op (the
    intermediates its gradient reads), so the cost model must not build it aside: planning
    changed the user's graph, and a plan simulated after the view was numbered read outputs
    the numbering did not have (an IndexError)."""
    ws = square_weights(9, WIDTH)
    x = tf.constant(np.random.RandomState(2).randn(4, WIDTH).astype(np.float32))

    @tf.function
    def step(flag, steps):
        loss_a, _ = cond_model(ws, x, flag)
        loss_b, named = while_model(ws, x, steps)
        loss = loss_a + loss_b
        graph = loss.graph
        control_flow = [op for op in graph.get_operations() if op.type in _tf.CONTROL_FLOW_TYPES]
        outputs = [len(op.outputs) for op in control_flow]
        plan = msg.plan(loss, ws, checkpoints=[named["after"]])
        assert plan.peak_bytes > 0
        assert [len(op.outputs) for op in control_flow] == outputs
        assert len(control_flow) == 2
        return loss

    step(tf.constant(1.0), tf.constant(2))


@pytest.mark.parametrize("strategy", ["memory", "speed", "list"])
def test_control_flow_in_a_tf_function(strategy):
    ws = square_weights(9, WIDTH)
    x = tf.constant(np.random.RandomState(2).randn(4, WIDTH).astype(np.float32))

    @tf.function
    def step(flag, steps):
        loss_a, named_a = cond_model(ws, x, flag)
        loss_b, named_b = while_model(ws, x, steps)
        loss = loss_a + loss_b
        chosen = [named_a["cond"], named_b["after"]] if strategy == "list" else strategy
        plan = msg.plan(loss, ws, checkpoints=chosen)
        got = msg.gradients(loss, ws, checkpoints=chosen)
        assert_recomputes_where_it_pays(plan)
        return tf.gradients(loss, ws), got

    for flag, steps in [(1.0, 2), (-1.0, 4)]:
        reference, got = step(tf.constant(flag), tf.constant(steps))
        assert_same_gradients(numpy(reference), numpy(got))


def test_custom_gradient_functions_keep_their_gradient():
    @tf.custom_gradient
    def clipped_identity(v):
        def grad(dy):
            return tf.clip_by_value(dy, -0.01, 0.01)

        return tf.identity(v), grad

    def build(ws, x):
        h = x
        named = {}
        for i, w in enumerate(ws[:6]):
            h = clipped_identity(layer(h, w)) if i % 2 else layer(h, w)
            named[i] = h
        names = ("before", "cond", "after", "late")
        return tf.reduce_sum(h * h), {name: named[i + 1] for i, name in enumerate(names)}

    for checkpoints in (["before", "after"], ["cond"], "memory"):
        compare_in_session(build, checkpoints)


def test_recompute_grad_blocks_inside_the_model():
    ws = square_weights(6, WIDTH)
    x = tf.constant(np.random.RandomState(3).randn(4, WIDTH).astype(np.float32))
    block = tf.recompute_grad(lambda h: layer(layer(h, ws[2]), ws[3]))

    @tf.function
    def step():
        h0 = layer(layer(x, ws[0]), ws[1])
        h1 = block(h0)
        h2 = layer(layer(h1, ws[4]), ws[5])
        loss = tf.reduce_sum(h2 * h2)
        got = msg.gradients(loss, ws, checkpoints=[h0, h1])
        assert_recomputes(loss.graph)
        return tf.gradients(loss, ws), got

    reference, got = step()
    assert_same_gradients(numpy(reference), numpy(got))


def test_stop_gradient_regions():
    def build(ws, x):
        h0 = layer(layer(x, ws[0]), ws[1])
        frozen = tf.stop_gradient(layer(layer(h0, ws[2]), ws[3]))
        h1 = layer(h0 + frozen, ws[4])
        h2 = layer(layer(h1, ws[5]), ws[6])
        return tf.reduce_sum(h2), {"before": h0, "cond": frozen, "after": h1, "late": h2}

    for checkpoints in (["before"], ["cond", "after"], PLACES["all"], "memory"):
        compare_in_session(build, checkpoints)


@pytest.fixture
def control_flow_v1():
    """TF1 control flow for one test, then whatever was on before (TF1 behaviour has it)."""
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    yield
    if was_v2:
        tf1.enable_control_flow_v2()


@pytest.mark.parametrize("place", ["around", "memory", "speed"])
def test_tf1_while_loop_and_cond_frames(control_flow_v1, place):
    """TF1 control flow (Switch/Merge frames, a cycle through NextIteration): frame ops are
    never copied, checkpoints around them still work."""

    def build(ws, x):
        h0 = layer(layer(x, ws[0]), ws[1])
        _, looped = tf1.while_loop(
            lambda i, a: i < 3, lambda i, a: (i + 1, layer(a, ws[2])), (0, h0)
        )
        chosen = tf1.cond(tf.reduce_sum(looped) > 0, lambda: layer(looped, ws[3]), lambda: looped)
        h1 = layer(chosen, ws[4]) + h0
        h2 = layer(layer(h1, ws[5]), ws[6])
        return tf.reduce_sum(h2 * h2), {"before": h0, "cond": chosen, "after": h1, "late": h2}

    graph = compare_in_session(build, PLACES.get(place, place))
    copied_types = {op.type for op in recomputed_copies(graph)}
    assert copied_types
    assert not copied_types & {"Enter", "Exit", "Merge", "Switch", "NextIteration", "LoopCond"}


def control_flow_block(h, v, kind: str):
    """A while loop, cond or switch_case of tanh(h @ v) (and sin)."""
    if kind == "while":
        return tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, tf.tanh(a @ v)), (0, h))[1]
    branches = [lambda: tf.tanh(h @ v), lambda: tf.sin(h @ v)]
    if kind == "cond":
        return tf.cond(tf.reduce_sum(h) > 0, *branches)
    return tf.switch_case(tf.cast(tf.reduce_sum(h) > 0, tf.int32), branches)


def stateless_control_flow_chain(ws, x, kind: str):
    """Blocks of `control_flow_block` given their weight's value (stateless ops, which plans
    recompute)."""
    h = x
    for w in ws:
        h = h + control_flow_block(h, tf.convert_to_tensor(w), kind)
    return tf.reduce_sum(h * h)


@pytest.mark.tf2_only
@pytest.mark.parametrize("kind", ["while", "cond", "switch_case"])
def test_recomputed_control_flow_differentiated_again(kind):
    """The gradient of a TF2 loop or cond rewrites its functions under names derived from them:
    a copy reading the original's functions collided with the original's rewrite ("Attempting
    to add a duplicate function") when both were differentiated (NOTE [copied control flow])."""
    ws = square_weights(6, 32)
    x = tf.constant(np.random.RandomState(0).randn(16, 32).astype(np.float32))

    @tf.function
    def step():
        loss = stateless_control_flow_chain(ws, x, kind)
        first = msg.gradients(loss, ws, checkpoints="memory")
        assert_recomputes(tf1.get_default_graph())
        second = msg.gradients(loss, ws, checkpoints="speed")
        return tf.gradients(loss, ws), first, second

    reference, first, second = step()
    assert_same_gradients(numpy(reference), numpy(first))
    assert_same_gradients(numpy(reference), numpy(second))
