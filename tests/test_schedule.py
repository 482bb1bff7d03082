"""The schedule of checkpointed backprop: which ops a checkpoint list recomputes in several steps.

`schedule.recomputed_repeatedly` finds them in two linear walks; here it is checked against the
definition, the ops shared by the segments of several steps of a built `Schedule`, on random
graphs with random checkpoint lists and with the matmul and convolution outputs 'speed' starts
from, and on the residual network that made 'speed' quadratic.
"""

import os

import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings

import memory_saving_gradients as msg
from memory_saving_gradients._src.analysis import arguments
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning.saving import EXPENSIVE_OP_TYPES
from memory_saving_gradients._src.planning.schedule import Schedule, recomputed_repeatedly
from tests.random_graphs import Variables, build, programs

EXAMPLES = int(os.environ.get("MSG_PROPERTY_EXAMPLES", "200"))


def view_of(ys, xs) -> ForwardView:
    """The view `msg.gradients(ys, xs)` checkpoints."""
    args = arguments.parse(ys, xs, None, None, tf.UnconnectedGradients.NONE)
    return ForwardView.build(args.ys, args.unique_xs)


def in_several_steps(schedule: Schedule) -> set[tf.Operation]:
    """The ops in the segments of more than one step: each of those steps recomputes them."""
    seen: set[tf.Operation] = set()
    repeated: set[tf.Operation] = set()
    for step in schedule.steps:
        ops = step.segment.ops
        repeated |= ops & seen
        seen |= ops
    return repeated


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MSG_PROPERTY_EXAMPLES"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(programs())
def test_repeated_recomputation_matches_the_built_schedule(program):
    with tf.Graph().as_default():
        built = build(program, Variables.create(program))
        args = arguments.parse(built.ys, built.xs, None, None, tf.UnconnectedGradients.NONE)
        if args.only_tensorflow or not (flowing := args.without_constant_ys()).ys:
            return
        view = ForwardView.build(flowing.ys, flowing.unique_xs)
        listed = [built.values[i] for i in program.checkpoints]
        expensive = [out for op in view.ops if op.type in EXPENSIVE_OP_TYPES for out in op.outputs]
        for candidates in (listed, expensive):
            checkpoints = [t for t in candidates if t.op in view.recomputable]
            expected = in_several_steps(Schedule.build(view, checkpoints))
            event(f"ops recomputed repeatedly: {bool(expected)}")
            assert recomputed_repeatedly(view, checkpoints) == expected


def residual_mlp(blocks: int):
    """`h = l2_normalize(h + relu(matmul(h, w) * 0.5 + 0.1))`: the skip path holds no matmul."""
    weights = [tf.Variable(tf.eye(8), name=f"w{i}") for i in range(blocks)]
    h = tf.compat.v1.placeholder(tf.float32, [4, 8])
    for w in weights:
        a = tf.nn.relu(tf.matmul(h, w) * 0.5 + 0.1)
        h = tf.math.l2_normalize(h + a, axis=-1)
    return tf.reduce_sum(h), weights


def test_matmul_outputs_leave_the_skip_path_recomputed_in_every_later_segment():
    with tf.Graph().as_default():
        loss, weights = residual_mlp(6)
        view = view_of(loss, weights)
        matmuls = [op.outputs[0] for op in view.ops if op.type == "MatMul"]
        repeated = recomputed_repeatedly(view, matmuls)
        assert repeated == in_several_steps(Schedule.build(view, matmuls))
        assert {op.type for op in repeated} >= {"AddV2", "Rsqrt"}


def test_speed_cuts_the_skip_path_so_each_op_is_recomputed_once():
    with tf.Graph().as_default():
        loss, weights = residual_mlp(6)
        plan = msg.plan(loss, weights, checkpoints="speed")
        assert not recomputed_repeatedly(view_of(loss, weights), plan.checkpoints)
        assert not in_several_steps(plan.schedule)
        # The matmul outputs are kept (saved inside segments), and the skip path is cut.
        assert {t.op.type for t in plan.saved} == {"MatMul"}
        assert len(plan.checkpoints) + len(plan.saved) > len(weights)
