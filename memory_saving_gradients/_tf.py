"""Every TensorFlow private API the library relies on, each behind one small function.

TensorFlow 2 ships no graph editor, so copying ops, adding control inputs and calling the real
gradient implementation go through private methods of `tf.Graph` and `tf.Operation`. Keeping
them here means a TensorFlow release that changes one breaks one function, and
`tests/test_tf_compat.py` names it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import Literal, NamedTuple

import tensorflow as tf
from tensorflow.python.eager import backprop_util
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import (
    control_flow_util,
    default_gradient,
    gradients_impl,
    gradients_util,
    handle_data_util,
    resource_variable_ops,
)
from tensorflow.python.ops import gradients as gradients_module


@contextlib.contextmanager
def _outside_caller_scopes(graph: tf.Graph) -> Iterator[None]:
    """Build ops in `graph` free of the caller's control-dependency, name and colocation scopes."""
    with (
        graph.as_default(),
        tf_ops.control_dependencies(None),
        tf_ops.name_scope(None),
        graph.colocate_with(None, ignore_existing=True),
    ):
        yield


def copy_op(op: tf.Operation, inputs: Sequence[tf.Tensor], name: str) -> tf.Operation:
    """Create a copy of `op` reading `inputs`, with the same type, attributes, device and shapes.

    The copy ignores whatever device, colocation, control-dependency and name scopes the caller
    is in: it is placed exactly like the original. `name` is made unique by the graph.
    """
    graph = op.graph
    with _outside_caller_scopes(graph):
        copy = graph._create_op_internal(
            op.type,
            list(inputs),
            dtypes=[out.dtype for out in op.outputs],
            input_types=[t.dtype for t in op.inputs],
            name=name,
            attrs={key: op.node_def.attr[key] for key in op.node_def.attr},
            op_def=op.op_def,
            compute_device=False,
        )
    copy._set_device(op.device)
    copy._gradient_function = op._gradient_function
    for original, copied in zip(op.outputs, copy.outputs, strict=True):
        copied.set_shape(original.shape)
        handle_data_util.copy_handle_data(original, copied)
    return copy


def identity_like(tensor: tf.Tensor, name: str) -> tf.Tensor:
    """An Identity of `tensor` placed like its producer, outside the caller's scopes."""
    graph = tensor.graph
    with _outside_caller_scopes(graph):
        identity = graph._create_op_internal(
            "Identity", [tensor], dtypes=[tensor.dtype], name=name, compute_device=False
        )
    identity._set_device(tensor.op.device)
    output = identity.outputs[0]
    output.set_shape(tensor.shape)
    handle_data_util.copy_handle_data(tensor, output)
    return output


def is_differentiable(tensor: tf.Tensor) -> bool:
    """Whether TensorFlow's gradient functions propagate gradients through `tensor`'s dtype."""
    return backprop_util.IsTrainable(tensor)


def add_control_inputs(op: tf.Operation, control_ops: Iterable[tf.Operation]) -> None:
    """Make `op` wait for every op in `control_ops` (those it already waits for are skipped)."""
    missing = [c for c in control_ops if c not in op.control_inputs]
    if missing:
        op._add_control_inputs(missing)


def is_stateful(op: tf.Operation) -> bool:
    """Whether running `op` twice may give different results or side effects."""
    return op._is_stateful


def is_resource_variable(value: object) -> bool:
    """Whether `value` is differentiated through its resource handle, as `tf.GradientTape` does:
    `tf.Variable`, distributed variables, Keras 3 variables and other variable-like objects."""
    return resource_variable_ops.is_resource_variable(value)


def in_v1_control_flow(op: tf.Operation) -> bool:
    """Whether `op` lives inside a TF1 while loop or cond (Switch/Merge frames)."""
    return op._get_control_flow_context() is not None


def compiled_by_xla(graph: tf.Graph) -> bool:
    """Whether `graph` (or a graph it is nested in) is being built for XLA compilation, as in
    `tf.function(jit_compile=True)`."""
    return control_flow_util.GraphOrParentsInXlaContext(graph)


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
) -> list:
    """TensorFlow's own `tf.gradients`, reached even while `tf.gradients` is patched.

    Unconnected xs get None so that the caller can tell them apart from zero gradients.
    """
    graph = ys[0].graph
    with graph._mutation_lock():
        return gradients_util._GradientsHelper(
            ys,
            xs,
            grad_ys,
            name,
            colocate_gradients_with_ops,
            gate_gradients,
            aggregation_method,
            stop_gradients,
            tf.UnconnectedGradients.NONE,
        )


def zero_gradient(x: tf.Tensor) -> tf.Tensor:
    """The zero gradient `tf.gradients` gives an unconnected x (resource handles included)."""
    return default_gradient.zeros_like(x)


def sum_gradients(gradients: Sequence) -> tf.Tensor | tf.IndexedSlices:
    """Sum gradient parts as `tf.gradients` does: IndexedSlices stay sparse unless mixed."""
    return backprop_util.AggregateIndexedSlicesGradients(list(gradients))


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
