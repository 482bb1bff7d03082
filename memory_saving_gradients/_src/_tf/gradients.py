"""TensorFlow's own gradient machinery: an op's registered gradient built aside, the real
`tf.gradients` (reached even while it is patched), how it sums and fills gradients, and where
TensorFlow code finds it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Literal, NamedTuple

import tensorflow as tf
from tensorflow.python.eager import backprop_util
from tensorflow.python.framework import func_graph
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import default_gradient, gradients_impl, gradients_util
from tensorflow.python.ops import gradients as gradients_module

from memory_saving_gradients._src._tf.functions import is_function_call


class GradientAside(NamedTuple):
    """An op's registered gradient, built once more in a function body of its own.

    Attributes:
      graph: the function body.
      output_gradients: placeholders standing for the gradients of the op's outputs (None for
        outputs that take none).
      input_gradients: what the gradient function returned for each input.
      read: for each outer tensor (by id) the gradient read, its placeholder in `graph`.
    """

    graph: tf.Graph
    output_gradients: list
    input_gradients: list
    read: dict[int, tf.Tensor]


#: TF2 control-flow ops: their registered gradients add outputs to the forward op (the
#: intermediates the gradient reads), so building one aside would change the user's graph.
CONTROL_FLOW_TYPES = frozenset(
    {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"}
)


def gradient_aside(op: tf.Operation) -> GradientAside | None:
    """`op`'s registered gradient built in a function body of its own, to see what it reads and
    makes; None where that cannot be done without side effects (function calls and control
    flow rewrite their forward op, custom gradients), or `op` has no gradient."""
    if (
        op._gradient_function is not None
        or is_function_call(op)
        or op.type in CONTROL_FLOW_TYPES
        or "_gradient_op_type" in op.node_def.attr
    ):
        return None
    try:
        function = tf_ops._gradient_registry.lookup(op.type)
    except LookupError:
        return None
    if function is None:
        return None
    body = func_graph.FuncGraph("gradient_aside")
    body.outer_graph = op.graph
    try:
        with body.as_default():
            output_gradients = [
                tf.compat.v1.placeholder(t.dtype, t.shape) if is_differentiable(t) else None
                for t in op.outputs
            ]
            gradients = function(op, *output_gradients)
    except Exception:  # a gradient that cannot be built aside: its use stays unknown
        return None
    gradients = list(gradients) if isinstance(gradients, (list, tuple)) else [gradients]
    read = {id(outer): inner for outer, inner in body.captures}
    return GradientAside(body, output_gradients, gradients, read)


def is_differentiable(tensor: tf.Tensor) -> bool:
    """Whether TensorFlow's gradient functions propagate gradients through `tensor`'s dtype."""
    return backprop_util.IsTrainable(tensor)


def tensorflow_gradients(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    grad_ys: Sequence[tf.Tensor | None] | None,
    *,
    name: str,
    colocate_gradients_with_ops: bool,
    gate_gradients: bool,
    aggregation_method,
    stop_gradients: Sequence[tf.Tensor],
    boundaries: Sequence[tf.Tensor] = (),
    unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
) -> list:
    """TensorFlow's own `tf.gradients`, reached even while `tf.gradients` is patched.

    Backprop also stops at `boundaries`: they receive gradients, their producers pass none
    on. Unlike `stop_gradients`, that holds at function-call ops too (NOTE below).
    """
    graph = tf.compat.v1.get_default_graph()
    calls = [op for op in dict.fromkeys(t.op for t in boundaries) if is_function_call(op)]
    stops = [*stop_gradients, *(t for t in boundaries if t.op not in calls)]
    with graph._mutation_lock(), _passing_no_gradient(calls):
        return gradients_util._GradientsHelper(
            ys,
            xs,
            grad_ys,
            name,
            colocate_gradients_with_ops,
            gate_gradients,
            aggregation_method,
            stops,
            unconnected_gradients,
        )


# NOTE [function calls in stop_gradients]: TensorFlow's gradient code differentiates a
# function-call op listed in stop_gradients all the same (it falls back to a
# SymbolicGradient of the call), so gradients flow on past it. A checkpointed backward pass
# stops at every boundary and differentiates what lies behind it later, so a boundary made by
# a call op would be crossed twice: twice the gradient. Such an op is given a gradient
# function that passes nothing on while TensorFlow differentiates, which stops backprop there.
@contextlib.contextmanager
def _passing_no_gradient(ops: Sequence[tf.Operation]) -> Iterator[None]:
    saved = [(op, op._gradient_function) for op in ops]
    for op in ops:
        op._gradient_function = _no_gradient
    try:
        yield
    finally:
        for op, function in saved:
            op._gradient_function = function


def _no_gradient(op: tf.Operation, *output_gradients) -> list[None]:
    return [None] * len(op.inputs)


def zero_gradient(x: tf.Tensor) -> tf.Tensor:
    """The zero gradient `tf.gradients` gives an unconnected x (resource handles included)."""
    return default_gradient.zeros_like(x)


def sum_gradients(gradients: Sequence) -> tf.Tensor | tf.IndexedSlices:
    """Sum gradient parts as `tf.gradients` does: IndexedSlices stay sparse unless mixed;
    dense parts are summed on each device they lie on, colocated with the first of them, and
    those sums together (where they lie on several)."""
    if any(isinstance(g, tf.IndexedSlices) for g in gradients):
        return backprop_util.AggregateIndexedSlicesGradients(list(gradients))
    if len(gradients) == 1:
        return gradients[0]
    return gradients_util._MultiDeviceAddN(list(gradients), "__unsupported__")


class EntryPoint(NamedTuple):
    """A module attribute through which TensorFlow code reaches `tf.gradients`."""

    module: ModuleType
    attribute: str
    original: Callable
    signature: Literal["v1", "v2"]


#: Where users, `tf.compat.v1.train.Optimizer` and Keras 2 find the gradient function.
GRADIENT_ENTRY_POINTS = (
    EntryPoint(tf, "gradients", gradients_impl.gradients_v2, "v2"),
    EntryPoint(tf.compat.v2, "gradients", gradients_impl.gradients_v2, "v2"),
    EntryPoint(tf.compat.v1, "gradients", gradients_impl.gradients, "v1"),
    EntryPoint(gradients_impl, "gradients", gradients_impl.gradients, "v1"),
    EntryPoint(gradients_module, "gradients", gradients_impl.gradients, "v1"),
)


def gradient_entry_points() -> list[EntryPoint]:
    """`GRADIENT_ENTRY_POINTS`, and `tf.compat.v1` and `tf.compat.v2` as they resolve now where
    they are other module objects: importing some packages (keras-hub, through
    tensorflow-text) makes `tf.compat.v2` a new module, whose `gradients` a patch of the
    module seen at import would miss."""
    points = list(GRADIENT_ENTRY_POINTS)
    for now, then in ((tf.compat.v2, points[1]), (tf.compat.v1, points[2])):
        if now is not then.module:
            points.append(then._replace(module=now))
    return points
