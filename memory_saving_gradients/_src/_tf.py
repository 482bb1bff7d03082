"""Every TensorFlow private API the library relies on, each behind one small function.

TensorFlow 2 ships no graph editor, so copying ops, adding control inputs and calling the real
gradient implementation go through private methods of `tf.Graph` and `tf.Operation`. Keeping
them here means a TensorFlow release that changes one breaks one function, and
`tests/test_tf_compat.py` names it. That is this module's one job, whatever the functions
reach into (editing built ops, function calls, TensorFlow's own gradients, the runtime): one
module holds every private API, so the layering test can say no other module touches any.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Literal, NamedTuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import backprop_util, record
from tensorflow.python.framework import func_graph, op_def_registry
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import (
    control_flow_util,
    control_flow_util_v2,
    default_gradient,
    gradients_impl,
    gradients_util,
    handle_data_util,
    resource_variable_ops,
)
from tensorflow.python.ops import gradients as gradients_module
from tensorflow.python.util import _pywrap_util_port


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


def differentiated_as(
    value: tf.Tensor,
    ops: Sequence[tf.Operation],
    frontier: Sequence[tf.Tensor],
    reads_output: bool = False,
) -> tf.Tensor:
    """`value` passed on unchanged (an IdentityN, which shares its buffer), differentiated as
    the one output of `ops[0]`, made by `ops` from `frontier`: the gradient arriving at it
    goes through the gradient functions of `ops` (each op before those making its inputs,
    given a gradient for each of its outputs; `ops[0]`'s reading `value` where it
    `reads_output`) into `frontier`, which the
    pass-through also reads (unchanged) for that, so none of `ops` need ever run. The
    gradient functions of the others must read none of their outputs, and none of the
    tensors `ops` pass among themselves. Built in the caller's scopes (the caller places it).
    """
    passed = tf.raw_ops.IdentityN(input=[value, *frontier])
    through = passed[0].op

    def gradient(unused_op: tf.Operation, gradient: tf.Tensor, *unused: tf.Tensor) -> list:
        arriving: dict[object, list] = {ops[0].outputs[0].ref(): [gradient]}
        for op in ops:
            function = tf_ops.get_gradient_function(op)
            parts = [arriving.pop(t.ref(), []) for t in op.outputs]
            if function is None or not any(parts):
                continue
            reading = _ReadingOutputs(op, [value]) if reads_output and op is ops[0] else op
            of_inputs = function(reading, *map(_summed_or_zeros, parts, op.outputs))
            of_inputs = of_inputs if isinstance(of_inputs, (list, tuple)) else [of_inputs]
            for tensor, part in zip(op.inputs, of_inputs, strict=False):
                if part is not None:
                    arriving.setdefault(tensor.ref(), []).append(part)
        reaching = [arriving.get(t.ref()) for t in frontier]
        return [None, *(sum_gradients(parts) if parts else None for parts in reaching)]

    through._gradient_function = gradient
    passed[0].set_shape(value.shape)
    handle_data_util.copy_handle_data(value, passed[0])
    return passed[0]


def _summed_or_zeros(parts: list, output: tf.Tensor) -> tf.Tensor:
    """The gradient of `output` from its `parts`, or zeros where none arrived (an output of a
    split that nothing differentiated reads), as `tf.gradients` gives an op's gradient
    function: of the output's static shape, else of its own (which then runs)."""
    if parts:
        return sum_gradients(parts)
    if output.shape.is_fully_defined():
        return tf.zeros(output.shape, output.dtype)
    return tf.zeros_like(output)


class _ReadingOutputs:
    """`op` as its gradient function sees it, with `outputs` in place of its own: its
    gradient reads those instead, and `op` itself need not run."""

    def __init__(self, op: tf.Operation, outputs: list[tf.Tensor]) -> None:
        self._op = op
        self.outputs = outputs

    def __getattr__(self, name: str) -> object:
        return getattr(self._op, name)


def copy_handle_data(source: tf.Tensor, target: tf.Tensor) -> None:
    """Give `target` the handle data of `source` (a resource's dtype and shape, which reading
    a variable through a pass-through needs)."""
    handle_data_util.copy_handle_data(source, target)


def is_function_call(op: tf.Operation) -> bool:
    """Whether `op` calls a function of the graph's library (a nested `tf.function`, a Keras
    layer called as one, a `Defun`)."""
    return op.type in ("PartitionedCall", "StatefulPartitionedCall") or op.graph._is_function(
        op.type
    )


def called_op_types(op: tf.Operation) -> frozenset[str]:
    """The op types in the bodies of the functions `op` calls (a function call, the branches
    of an If, the body of a While) and of the functions those call, from the graph's library.
    """
    return frozenset().union(
        *(_body_op_types(name, op.graph) for name in _called_function_names(op.node_def, op.graph))
    )


#: Stateful op types that only read a variable's value.
_VARIABLE_READ_TYPES = frozenset(
    {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp"}
)


def stateful_through_variable_reads(op: tf.Operation) -> bool:
    """Whether `op` is stateful only because functions it runs (a while loop's body, a cond's
    branches, a nested tf.function) read variables: the only stateful ops in them are variable
    reads and ops running further functions."""
    called = called_op_types(op)
    if not called:
        return False
    for op_type in called - _VARIABLE_READ_TYPES:
        op_def = op_def_registry.get(op_type)  # None for a library function called by name
        if op_def is not None and op_def.is_stateful and not _runs_functions(op_def):
            return False
    return True


def _runs_functions(op_def) -> bool:
    """Whether ops of `op_def` run functions (their attributes name them), whose bodies decide
    whether they are stateful (While, If, Case, StatefulPartitionedCall)."""
    return any(attr.type in ("func", "list(func)") for attr in op_def.attr)


#: Op types in each library function's body and callees, by name. A name stands for one body:
#: tf.function names are unique in a process, Defun names hash their definition. At most
#: `FUNCTIONS_KEPT` names are kept (each trace makes new ones); the oldest goes first.
_BODY_OP_TYPES: dict[str, frozenset[str]] = {}
FUNCTIONS_KEPT = 4096


def _body_op_types(name: str, graph: tf.Graph) -> frozenset[str]:
    if name not in _BODY_OP_TYPES:
        if len(_BODY_OP_TYPES) >= FUNCTIONS_KEPT:
            del _BODY_OP_TYPES[next(iter(_BODY_OP_TYPES))]
        _BODY_OP_TYPES[name] = frozenset()  # a function calling itself adds nothing new
        function = _library_function(graph, name)
        nodes = [] if function is None else function.definition.node_def
        _BODY_OP_TYPES[name] = frozenset(node.op for node in nodes).union(
            *(
                _body_op_types(callee, graph)
                for node in nodes
                for callee in _called_function_names(node, graph)
            )
        )
    return _BODY_OP_TYPES[name]


def _called_function_names(node_def, graph: tf.Graph) -> list[str]:
    """Names of the functions a NodeDef calls: its function attributes, or its op type for a
    call of a library function by name (`Defun`)."""
    names = [node_def.op] if _library_function(graph, node_def.op) is not None else []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


def _library_function(graph: tf.Graph, name: str):
    """Library function `name` of `graph` or of a graph it is nested in, or None."""
    while graph is not None:
        function = graph._get_function(name)
        if function is not None:
            return function
        graph = getattr(graph, "outer_graph", None)
    return None


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


def gradient_aside(op: tf.Operation, function: Callable | None = None) -> GradientAside | None:
    """`op`'s registered gradient, or `function` in its place, built in a function body of its
    own, to see what it reads and makes; None where that cannot be done without side effects
    (function calls and control flow rewrite their forward op, custom gradients), or `op` has
    no gradient."""
    if has_own_gradient(op) or is_function_call(op) or op.type in CONTROL_FLOW_TYPES:
        return None
    function = function or registered_gradient(op)
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


def registered_gradient(op: tf.Operation) -> Callable | None:
    """The gradient function TensorFlow registered for `op`'s type; None where it has none."""
    try:
        return tf_ops._gradient_registry.lookup(op.type)
    except LookupError:
        return None


def has_own_gradient(op: tf.Operation) -> bool:
    """Whether `op` is differentiated by a function of its own rather than its type's
    registered one (`tf.custom_gradient`, `gradient_override_map`, the rewrite's pass-throughs)."""
    return op._gradient_function is not None or "_gradient_op_type" in op.node_def.attr


def is_differentiable(tensor: tf.Tensor) -> bool:
    """Whether TensorFlow's gradient functions propagate gradients through `tensor`'s dtype."""
    return backprop_util.IsTrainable(tensor)


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


def tape_recording() -> bool:
    """Whether a GradientTape or ForwardAccumulator records the ops being built now: each
    records an op as its Python wrapper makes it, so it never sees the ops `copy_op` makes."""
    return record.could_possibly_record()


def is_stateful(op: tf.Operation) -> bool:
    """Whether running `op` twice may give different results or side effects."""
    return op._is_stateful


def is_resource_variable(value: object) -> bool:
    """Whether `value` is differentiated through its resource handle, as `tf.GradientTape` does:
    `tf.Variable`, distributed variables, Keras 3 variables and other variable-like objects."""
    return resource_variable_ops.is_resource_variable(value)


def in_v1_control_flow(op: tf.Operation) -> bool:
    """Whether `op` lives inside a TF1 while loop or cond (Switch/Merge frames). The context
    XLA compilation sets (`get_concrete_function` of a `jit_compile=True` function traces its
    ops inside one) is no frame."""
    return _in_frame(op._get_control_flow_context())


def building_in_v1_control_flow(graph: tf.Graph) -> bool:
    """Whether ops built now in `graph` go inside a TF1 while loop or cond: the caller is
    building a loop body or branch (as `tf.compat.v1.hessians` builds one gradient call per
    iteration)."""
    return _in_frame(graph._get_control_flow_context())


def _in_frame(context) -> bool:
    while context is not None:
        if context.IsWhileContext() or context.IsCondContext():
            return True
        context = context.outer_context
    return False


def onednn_enabled() -> bool:
    """Whether TensorFlow runs oneDNN's CPU kernels (the default on x86; TF_ENABLE_ONEDNN_OPTS=0
    turns them off)."""
    return bool(_pywrap_util_port.IsMklEnabled())


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
    boundaries: Sequence[tf.Tensor] = (),
    unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
    differentiated_by: Mapping[tf.Operation, Callable] | None = None,
) -> list:
    """TensorFlow's own `tf.gradients`, reached even while `tf.gradients` is patched.

    Backprop also stops at `boundaries`: they receive gradients, their producers pass none
    on. Unlike `stop_gradients`, that holds at function-call ops too (NOTE below). The ops
    of `differentiated_by` are differentiated by the function it gives them, for this call
    only: the graph's ops keep their own.
    """
    graph = tf.compat.v1.get_default_graph()
    calls = [op for op in dict.fromkeys(t.op for t in boundaries) if is_function_call(op)]
    stops = [*stop_gradients, *(t for t in boundaries if t.op not in calls)]
    functions = {**(differentiated_by or {}), **dict.fromkeys(calls, _no_gradient)}
    with graph._mutation_lock(), _differentiated_by(functions):
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
def _differentiated_by(functions: dict[tf.Operation, Callable]) -> Iterator[None]:
    """Each op of `functions` differentiated by its function while in this context."""
    saved = [(op, op._gradient_function) for op in functions]
    for op, function in functions.items():
        op._gradient_function = function
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


def read_profile(directory: str):
    """The `XSpace` (TensorFlow's profile protocol buffer) that `tf.profiler.experimental`
    wrote under `directory`: TensorFlow has no public reader of its own profiles."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"The profiler wrote no profile under {directory}.")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as file:
        space.ParseFromString(file.read())
    return space
