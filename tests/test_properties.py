"""Property tests: on random graphs, checkpointed gradients equal tf.gradients, or a documented
error is raised.

Random DAGs of elementwise ops, matmuls, concat/split, reductions, broadcasting, residual and
multi-branch joins, function-call ops (nested tf.function layers, stateless and reading
variables, a tf.custom_gradient inside), and patterns oneDNN fuses (conv2d + bias + fused batch
norm + relu, matmul + bias + relu, depthwise conv2d + bias + relu6), with several ys and xs
(variables and intermediate tensors), optional grad_ys, every strategy, and random checkpoint
lists that may name xs, ys, duplicates, side branches and tensors off every path from xs to ys.
MSG_PROPERTY_EXAMPLES sets how many graphs each test tries (default 200 in a Session, a
quarter of that in tf.function).
"""

import contextlib
import os
import re

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, event, example, given, settings

import memory_saving_gradients as msg
from tests.helpers import assert_same_gradients, dense, run_with_nones, values
from tests.random_graphs import FUSABLE, PLANNED, Program, Variables, build, programs

tf1 = tf.compat.v1
EXAMPLES = int(os.environ.get("MSG_PROPERTY_EXAMPLES", "200"))
#: Values stay of order one, so terms that cancel (x - x) leave float32 round-off of order 1e-7.
ROUND_OFF = 1e-6
#: A convolution's bias followed by training-mode batch norm, which removes any shift: its
#: gradient is zero analytically, and what both sides compute is round-off of the gradients
#: summed into it (2e-6 against 5e-6 where the largest gradient entry was 14).
ZERO_BY_CONSTRUCTION = re.compile(r"conv_bn_relu\d+_1(_\d+)?:0")
#: Found by a V1 campaign: the first gradient reaching a step is computed from constants
#: only (the ys' Fills of ones through a matmul by a constant), which grappler folded into
#: the gate's zero; the gate's slices became identities it dropped, and oneDNN fused a
#: recomputed Conv2DBackpropFilter with a BiasAddGrad before the gate into a cycle.
FOLDABLE_GATE = Program(
    inputs=3,
    steps=(
        *(("identity", (i,)) for i in (0, 2, 4)),
        ("split", (4,)),
        ("identity", (5,)),
        ("split", (8,)),
        *(("identity", (i,)) for i in (8, 0, 11, 12, 0, 8, 16, 15, 17, 3, 13, 4)),
        ("matmul_two", (19, 20)),
        ("identity", (21,)),
        ("identity", (23,)),
        ("conv_bn_relu_inference", (10,)),
        ("identity", (26,)),
    ),
    ys=(27, 25),
    extra_xs=(),
    weights_as_xs=True,
    strategy="speed",
    budget=0.5,
    checkpoints=(),
    grad_ys=False,
)
COMMON = {
    "deadline": None,
    "derandomize": not os.environ.get("MSG_PROPERTY_EXAMPLES"),
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "database": None,
}


def checkpointed(program: Program, built) -> list | None:
    """msg.gradients for the program, or None when it raises the documented error."""
    kinds = {kind for kind, _ in program.steps}
    event(f"function calls: {any(kind.startswith('call_') for kind in kinds)}")
    event(f"fusable patterns: {not kinds.isdisjoint(FUSABLE)}")
    if program.strategy == "list":
        checkpoints = [built.values[i] for i in program.checkpoints]
    elif program.strategy == "budget":
        checkpoints = msg.MemoryBudget(program.budget)
    else:
        checkpoints = program.strategy
        if program.strategy == "collection":
            for i in program.checkpoints:
                msg.add_checkpoint(built.values[i])
    graph = tf1.get_default_graph()
    before = len(graph.get_operations())
    try:
        gradients = msg.gradients(built.ys, built.xs, built.grad_ys, checkpoints=checkpoints)
    except msg.NoCheckpointsError:
        assert program.strategy not in PLANNED, "planned checkpoints must never refuse"
        event(f"{program.strategy}: no usable checkpoint (documented error)")
        return None
    added = graph.get_operations()[before:]
    recomputed = any("/recompute_" in op.name for op in added)
    event(f"{program.strategy}: {'recomputed' if recomputed else 'nothing to recompute'}")
    return gradients


def assert_equal_gradients(names: list[str], want: list, have: list) -> None:
    """`have` equals `want` to float32 round-off; gradients of the xs named zero by
    construction to round-off of the largest gradient entry."""
    zero = [bool(ZERO_BY_CONSTRUCTION.fullmatch(name)) for name in names]
    largest = max((float(np.abs(dense(w)).max()) for w in want if w is not None), default=1.0)
    for by_construction, atol in ((False, ROUND_OFF), (True, ROUND_OFF * max(1.0, largest))):
        chosen = [i for i, z in enumerate(zero) if z == by_construction]
        assert_same_gradients(
            [want[i] for i in chosen], [have[i] for i in chosen], rtol=1e-4, atol=atol
        )


@settings(max_examples=EXAMPLES, **COMMON)
@given(programs())
@example(FOLDABLE_GATE)
def test_random_graphs_in_a_session(program):
    with tf.Graph().as_default():
        built = build(program, Variables.create(program))
        reference = tf1.gradients(built.ys, built.xs, built.grad_ys)
        got = checkpointed(program, built)
        if got is None:
            return
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            want, have = run_with_nones(session, [reference, got])
    assert_equal_gradients([x.name for x in built.xs], want, have)


@settings(max_examples=max(EXAMPLES // 4, 10), **COMMON)
@given(programs(max_steps=12))
@example(FOLDABLE_GATE)
def test_random_graphs_in_a_tf_function(program):
    """Eagerly, the function runs; under TF1 behaviour, its call op runs in a Session of a
    graph of its own."""
    with contextlib.nullcontext() if tf.executing_eagerly() else tf.Graph().as_default():
        results = {}
        variables = Variables.create(program)

        @tf.function
        def step():
            built = build(program, variables)
            results["names"] = [x.name for x in built.xs]
            results["reference"] = tf.gradients(built.ys, built.xs, built.grad_ys)
            results["got"] = checkpointed(program, built)
            present = [g for g in results["reference"] + (results["got"] or []) if g is not None]
            return present

        found = iter(values(step()))
    if results["got"] is None:
        return

    def fill(gradients):
        return [None if g is None else np.asarray(next(found)) for g in gradients]

    want = fill(results["reference"])
    have = fill(results["got"])
    assert_equal_gradients(results["names"], want, have)
