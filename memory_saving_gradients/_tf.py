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
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import backprop_util
from tensorflow.python.framework import func_graph
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import (
    control_flow_util,
    default_gradient,
    gen_array_ops,
    gradients_impl,
    gradients_util,
    handle_data_util,
    resource_variable_ops,
)
from tensorflow.python.ops import gradients as gradients_module


@contextlib.contextmanager
def _outside_caller_scopes(graph: tf.Graph) -> Iterator[None]:
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
    graph = op.graph
    attrs = dict(op.node_def.attr)  # the NodeDef is serialized on each access
    # In the original's colocation group, so that what TensorFlow colocates with the copy
    # (the gradients built from it) is colocated with the original, as `tf.gradients` has it.
    attrs["_class"] = attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(s=op.colocation_groups())
    )
    with _outside_caller_scopes(graph):
        copy = graph._create_op_internal(
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
    return copy


def gate(
    tensors: Sequence[tf.Tensor], after: tf.Tensor, waits: Sequence[tf.Tensor], scope: str
) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """`tensors`, each passed on, placed like it, once `after` and all of `waits` exist.
    Returns the passed tensors and what later ops are to read in place of `waits`.

    Outside XLA a tensor passes through a StridedSlice of its whole extent (no copy) starting
    at a zero computed, at run time, from one element of `after`, and made after `waits`
    (control dependencies: when one of `waits` is done, the executor has nothing of ours to
    run, so it runs that tensor's other readers). Graph optimizers can neither fold that
    zero nor drop the dependency, as they drop identities, IdentityN outputs nobody reads and
    reshapes to a known shape. Inside an XLA-compiled function a tensor is passed on as
    itself minus a zero computed from one element of `after` and of each of `waits` (NOTE
    [gates under XLA]); `waits` are returned as they are.
    """
    graph = tensors[0].graph
    with _outside_caller_scopes(graph), tf_ops.name_scope(scope):
        if compiled_by_xla(graph):
            with graph.device(after.op.device):
                zero = _xla_zero_computed_from([after, *waits])
            gated = [_minus_zero(tensor, zero) for tensor in tensors]
        else:
            with graph.device(after.op.device), tf_ops.control_dependencies(waits):
                zero = _zero_computed_from(after)
            starts: dict[int | None, tuple] = {}
            gated = [_passed_after(tensor, zero, starts) for tensor in tensors]
    for tensor, output in zip(tensors, gated, strict=True):
        output.set_shape(tensor.shape)
        handle_data_util.copy_handle_data(tensor, output)
    return list(gated), list(waits)


# NOTE [gates under XLA]: XLA ignores control dependencies, and its CPU compiler expands
# optimization barriers before layout assignment, after which CSE merges every recomputed op
# back into its original (32-layer chain: 63 tanh in the HLO before optimization, 32 after;
# peak as plain's). A data dependency is semantics, which no pass may drop: each tensor a step
# reads becomes `tensor - zero`, `zero` computed at run time from one element of an incoming
# gradient and of each waited-for gradient part (as tf.recompute_grad does). No original
# reads those values (no CSE), and they exist only once backprop reaches the step (no
# hoisting into the forward pass). `x - (+0)` is `x` bit for bit, signed zeros and NaNs
# included. It fuses into elementwise readers; before a matmul it is a copy, which also orders
# the reads of a variable before its update, so XLA can update it in place. The `exp` keeps XLA
# from duplicating `zero` into each reader, which would re-read the waited-for parts and keep
# them alive (Keras, 24 Dense layers: XLA's temporary buffer 28 MiB without it, 22 with it).


def _zero_computed_from(tensor: tf.Tensor) -> tf.Tensor:
    """An int64 zero computed from the first element of `tensor` (an element, or its real
    part, is never less than itself, NaN included), plus a zero constant folding cannot see.

    Where `tensor` is itself computed from constants (an unseeded ys' gradient is a Fill of
    ones), grappler folds the zero to a constant and then each slice of a gate to an identity
    it drops, so ops after the gate read what ops before it read, and oneDNN's fusion of
    Conv2DBackpropFilter with BiasAddGrad closes a cycle through the gate (the step never
    runs: "Retval[0] does not have value" in a Session, "nodes in a cycle" in a function).
    A PlaceholderWithDefault is never folded."""
    unseen = _unfoldable_zero(tensor.graph)
    rank = tensor.shape.rank
    if tensor.dtype in (tf.resource, tf.variant, tf.string) or rank is None:
        with tf_ops.control_dependencies([tensor.op]):
            return tf.identity(unseen, name="zero")
    first = tensor
    if rank:
        zeros, ones = _constant(tensor.graph, [0] * rank), _constant(tensor.graph, [1] * rank)
        first = gen_array_ops.strided_slice(tensor, zeros, ones, ones)
    if first.dtype.is_complex:
        first = tf.math.real(first)
    elif first.dtype == tf.bool:
        first = tf.cast(first, tf.int8)
    unequal = tf.cast(tf.less(first, first), tf.int64)
    return tf.add(
        tf.reduce_sum(unequal, _constant(tensor.graph, list(range(rank)))), unseen, name="zero"
    )


def _constant(graph: tf.Graph, value: int | list[int]) -> tf.Tensor:
    """An int64 constant of `graph`, made once and found again by its name (a cache outside
    the graph would hold the graph, and everything it captured, alive)."""
    values = value if isinstance(value, list) else [value]
    name = "memory_saving_gradients_int64_" + "_".join(str(v) for v in values)
    if not isinstance(value, list):
        name += "_scalar"
    return _made_once(graph, name, lambda: tf.constant(value, tf.int64, name=name))


def _unfoldable_zero(graph: tf.Graph) -> tf.Tensor:
    """An int64 zero of `graph` that graph optimizers do not know to be zero, made once."""
    name = "memory_saving_gradients_unfoldable_zero"
    return _made_once(
        graph,
        name,
        lambda: tf.compat.v1.placeholder_with_default(_constant(graph, 0), [], name=name),
    )


def _made_once(graph: tf.Graph, name: str, make: Callable[[], tf.Tensor]) -> tf.Tensor:
    """The tensor `make` builds in `graph`, outside the caller's scopes, under `name`; built
    on the first call and found again by its name on later ones."""
    try:
        return graph.get_operation_by_name(name).outputs[0]
    except KeyError:
        with _outside_caller_scopes(graph):
            return make()


def _xla_zero_computed_from(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """An int64 zero computed from the first element of each of `tensors`, as one scalar that
    XLA materialises once (NOTE [gates under XLA])."""
    numbers = [t for t in tensors if t.dtype not in (tf.resource, tf.variant, tf.string)]
    if not numbers:
        return _zero_computed_from(tensors[0])
    firsts = [tf.cast(tf.reshape(t, [-1])[:1], tf.float32) for t in numbers]
    first = tf.math.exp(tf.reduce_max(tf.concat(firsts, axis=0)))
    nan = tf.math.is_nan(first)
    return tf.cast(tf.logical_and(nan, tf.logical_not(nan)), tf.int64, name="zero")


def _minus_zero(tensor: tf.Tensor, zero: tf.Tensor) -> tf.Tensor:
    """`tensor - zero` (bit for bit `tensor`), `tensor or False` for booleans; other dtypes
    (resources, variants, strings) pass through an identity waiting for `zero`."""
    dtype = tensor.dtype
    with placed_like(tensor):
        if dtype == tf.bool:
            return tf.logical_or(tensor, tf.cast(zero, tf.bool))
        if dtype.is_floating or dtype.is_complex or dtype.is_integer:
            return tf.subtract(tensor, tf.cast(zero, dtype))
        with tf_ops.control_dependencies([zero]):
            return gen_array_ops.identity(tensor)


def _passed_after(tensor: tf.Tensor, zero: tf.Tensor, starts: dict) -> tf.Tensor:
    """`tensor`, read once `zero` exists: a slice from `zero` onwards (the whole tensor, the
    same buffer) where slicing applies, an identity waiting for `zero` otherwise (resources,
    variants). `starts` shares the slices' starts, one per rank, placed like `zero`."""
    rank = tensor.shape.rank
    if tensor.dtype in (tf.resource, tf.variant) or rank is None:
        with placed_like(tensor), tf_ops.control_dependencies([zero]):
            return gen_array_ops.identity(tensor)
    if rank not in starts:
        with tf.device(zero.op.device):
            starts[rank] = tf.fill(_constant(tensor.graph, [rank]), zero)
    ones = _constant(tensor.graph, [1] * rank)
    with placed_like(tensor):
        return gen_array_ops.strided_slice(
            tensor, starts[rank], ones, ones, end_mask=(1 << rank) - 1
        )


@contextlib.contextmanager
def placed_like(tensor: tf.Tensor) -> Iterator[None]:
    """Build ops on `tensor`'s device and in its colocation group, named after its op, as
    TensorFlow places what passes a tensor on (the caller's device and colocation scopes are
    left)."""
    with (
        tensor.graph.colocate_with(tensor.op, ignore_existing=True),
        tf_ops.name_scope(tensor.op.name),
    ):
        yield


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


def add_control_inputs(op: tf.Operation, control_ops: Iterable[tf.Operation]) -> None:
    """Make `op` wait for every op in `control_ops` (those it already waits for are skipped)."""
    missing = [c for c in control_ops if c not in op.control_inputs]
    if missing:
        op._add_control_inputs(missing)


def creation_index(op: tf.Operation) -> int:
    """Where `op` was created in its graph: ops made later have larger indices."""
    return op._id


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
