"""Editing a built graph: copying ops as they are, and adding inputs and control inputs to
ops already made (TensorFlow 2 ships no graph editor)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util, control_flow_util_v2, handle_data_util


@contextlib.contextmanager
def outside_caller_scopes(graph: tf.Graph) -> Iterator[None]:
    """Build ops in `graph` free of the caller's control-dependency, name and colocation scopes.
    `control_dependencies(None)` also leaves the caller's control-flow context; XLA's
    compilation context (where `get_concrete_function` of a `jit_compile=True` function
    traces) is kept, so the ops built here are compiled, and seen to be, like the rest."""
    xla_context = control_flow_util.GetContainingXLAContext(graph._get_control_flow_context())
    with (
        graph.as_default(),
        tf_ops.control_dependencies(None),
        tf_ops.name_scope(None),
        graph.colocate_with(None, ignore_existing=True),
    ):
        if xla_context is not None:
            graph._set_control_flow_context(xla_context)  # restored on leaving the scopes
        yield


def copy_op(op: tf.Operation, inputs: Sequence[tf.Tensor], name: str) -> tf.Operation:
    """Create a copy of `op` reading `inputs`, with the same type, attributes, device and shapes.

    The copy ignores whatever device, colocation, control-dependency and name scopes the caller
    is in: it is placed exactly like the original. `name` is made unique by the graph.
    """
    with copying(op.graph) as copy:
        return copy(op, inputs, name)


@contextlib.contextmanager
def copying(
    graph: tf.Graph,
) -> Iterator[Callable[[tf.Operation, Sequence[tf.Tensor], str], tf.Operation]]:
    """`copy_op` for many ops of `graph`: the caller's scopes are left once for all of them
    (entering and leaving them is a fifth of the time a copy takes)."""
    with outside_caller_scopes(graph):
        yield _copy_op


def _copy_op(op: tf.Operation, inputs: Sequence[tf.Tensor], name: str) -> tf.Operation:
    """`copy_op`, outside the caller's scopes already."""
    attrs = dict(op.node_def.attr)  # the NodeDef is serialized on each access
    # In the original's colocation group, so that what TensorFlow colocates with the copy
    # (the gradients built from it) is colocated with the original, as `tf.gradients` has it:
    # the groups its `_class` names, else its own (`op.colocation_groups()`, read from `attrs`).
    groups = (
        [g for g in attrs["_class"].list.s if g.startswith(b"loc:@")] if "_class" in attrs else []
    )
    attrs["_class"] = attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(s=groups or [f"loc:@{op.name}".encode()])
    )
    copy = op.graph._create_op_internal(
        op.type,
        list(inputs),
        dtypes=[out.dtype for out in op.outputs],
        input_types=[t.dtype for t in op.inputs],
        name=name,
        attrs=attrs,
        op_def=op.op_def,
        compute_device=False,
    )
    copy._set_device(op.device)
    copy._gradient_function = op._gradient_function
    for original, copied in zip(op.outputs, copy.outputs, strict=True):
        copied.set_shape(original.shape)
        handle_data_util.copy_handle_data(original, copied)
    _give_own_function_graphs(copy)
    return copy


# NOTE [copied control flow]: the gradient of a TF2 while loop, cond or switch_case may
# rewrite the op's functions to output what the gradient reads, registering them under the
# name of the graph it builds for each function plus "_rewritten". It caches those graphs on
# the op, built from the function's name where the op has none: a copy reading the original's
# functions would get the original's name, so differentiating both (a checkpointed call, then
# `tf.gradients`; or two checkpointed calls) registers two different functions under one
# name, which TensorFlow refuses ("Attempting to add a duplicate function"). Each copy gets
# graphs of its own names.
_FUNCTION_GRAPHS = {
    **dict.fromkeys(
        ("While", "StatelessWhile"), (("cond", "_cond_graph"), ("body", "_body_graph"))
    ),
    **dict.fromkeys(
        ("If", "StatelessIf"), (("then_branch", "_true_graph"), ("else_branch", "_false_graph"))
    ),
}


def _give_own_function_graphs(copy: tf.Operation) -> None:
    """Cache on `copy` the graphs its gradient builds of the functions it runs, named its own
    (NOTE [copied control flow])."""
    if copy.type in ("Case", "StatelessCase"):
        named = [
            (function, f"_branch_graph_{i}")
            for i, function in enumerate(copy.get_attr("branches"))
        ]
    else:
        named = [
            (copy.get_attr(attr), cache) for attr, cache in _FUNCTION_GRAPHS.get(copy.type, ())
        ]
    if not named:
        return
    if copy.type.endswith("While"):
        shapes = [tf.TensorShape(shape) for shape in copy.get_attr("output_shapes")]
    else:
        shapes = [t.shape for t in copy.inputs[1:]]  # the first is the predicate or index
    for function, cache in named:
        graph = control_flow_util_v2.get_func_graph(copy, shapes, function.name)
        graph.name = f"{function.name}_recomputed_{tf_ops.uid()}"
        setattr(copy, cache, graph)


def differentiated_as(value: tf.Tensor, op: tf.Operation) -> tf.Tensor:
    """`value` passed on unchanged (an IdentityN, which shares its buffer), differentiated as
    the one output of `op`: the gradient arriving at it goes through `op`'s gradient function
    into `op`'s inputs, which the pass-through also reads (unchanged) for that, so `op`
    itself need never run. Built in the caller's scopes (the caller places it)."""
    passed = tf.raw_ops.IdentityN(input=[value, *op.inputs])
    through = passed[0].op
    function = tf_ops.get_gradient_function(op)

    def gradient(unused_op: tf.Operation, gradient: tf.Tensor, *unused: tf.Tensor) -> list:
        if function is None:
            return [None] * len(through.inputs)
        of_inputs = function(op, gradient)
        of_inputs = list(of_inputs) if isinstance(of_inputs, (list, tuple)) else [of_inputs]
        return [None, *of_inputs]

    through._gradient_function = gradient
    passed[0].set_shape(value.shape)
    handle_data_util.copy_handle_data(value, passed[0])
    return passed[0]


def copy_handle_data(source: tf.Tensor, target: tf.Tensor) -> None:
    """Give `target` the handle data of `source` (a resource's dtype and shape, which reading
    a variable through a pass-through needs)."""
    handle_data_util.copy_handle_data(source, target)


def add_control_inputs(op: tf.Operation, control_ops: Iterable[tf.Operation]) -> None:
    """Make `op` wait for every op in `control_ops` (those it already waits for are skipped)."""
    missing = [c for c in control_ops if c not in op.control_inputs]
    if missing:
        op._add_control_inputs(missing)


def replace_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """Make `op` read `tensor` as its input `index`."""
    op._update_input(index, tensor)


def creation_index(op: tf.Operation) -> int:
    """Where `op` was created in its graph: ops made later have larger indices."""
    return op._id
