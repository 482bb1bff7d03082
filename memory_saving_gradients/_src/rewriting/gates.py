"""Gates: what a backward step reads from before it, passed on only once backprop reaches it.

Each step of the rewrite (NOTE [gates]) reads the boundaries and arriving gradients through a
gate of its own, so that the executor recomputes nothing early and runs one step at a time;
`waits` says what else a step's gate waits for. A gate must survive graph optimizers (which
drop identities and fold what they can prove constant) and XLA (which ignores control
dependencies): it is a data dependency on a zero computed at run time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import kernels
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView

# NOTE [gates]: a step that recomputes reads what was made before it (the boundaries its
# copies read, the gradients arriving at its boundaries) through its gate, which passes each
# of them on once all exist and once every gradient part found since the last gate exists.
# So nothing is recomputed before backprop reaches the step (without the gate the executor
# runs copies as soon as their inputs exist, during the forward pass, and holds them), and a
# step starts only once the steps before it are done: the executor could otherwise leave
# their weight gradients queued, or start a step while an independent branch's backprop is
# still holding its activations. The backward pass runs one step at a time. A gate does not
# wait for parts of a branch whose forward pass need not have run when its own gradients
# arrive (`Execution.forward_before_gradients`): backprop from a loss seeded with constants
# reaches one chain of `a + b` before the other's forward pass, and waiting would hold the
# step's boundaries through that forward pass, as plain backprop does not (the original
# library's dual chain, tests/test_memory.py). A later gate waits for them. Conversely a
# step's gradients may arrive before the forward pass has made the boundary they arrive at:
# Keras's loss is a mean, `div_no_nan(sum, count)`, whose gradient for the sum reads the
# count alone. The gate then waits for that boundary's forward op too (a control dependency,
# outside XLA), or the executor recomputes the segment while the forward pass still runs it,
# and holds both (tests/test_gates.py); and so for the parts whose forward pass has run once
# that op has. A nested step reaches a softmax before the op making its outer copy, and the
# attention product's gradient reading that copy would otherwise run after the step has
# recomputed the softmax once more, both held (tests/test_memory.py).
#
# Graph optimizers fuse ops the rewrite does not control (oneDNN on x86 CPUs merges a
# BiasAddGrad into any Conv2DBackpropFilter that reads the same tensor, whatever lies between
# them). A fusion closes a cycle through a gate only if it merges an op before the gate with
# an op after it, and fusions merge ops that read one another or read one tensor. Ops after a
# gate read its outputs, their own step's copies and gradients, and constants; tensors made
# before it are read afterwards only by later gates and by the AddN summing gradient parts,
# and no fusion takes those in. Control dependencies alone give no such guarantee (a fused
# op inherits the control edges of what it absorbed), and XLA ignores them. A step without
# copies (variable reads) has no gate: it only passes arriving gradients on to kept tensors.


def waits(
    view: ForwardView, reached: Sequence[tf.Tensor], found: Sequence[tf.Tensor]
) -> tuple[list[bool], list[tf.Operation]]:
    """What the gate of a step whose gradients arrive at `reached` waits for besides them
    (NOTE [gates]): for each of `found` (what the gradient parts found since the last gate
    are for), whether its part is waited for, not left to a later gate; and the ops of `view`
    making `reached` whose forward pass need not have run when those gradients arrive."""
    execution = execution_of(view)
    ran = execution.forward_before_gradients(reached)
    making = dict.fromkeys(t.op for t in reached)
    not_run = [op for op in making if not ran >> view.position[op] & 1]
    ran |= execution.forward_through(not_run)
    picked = [not execution.forward_before_gradients([t]) & ~ran for t in found]
    return picked, not_run


def gate(
    tensors: Sequence[tf.Tensor],
    after: tf.Tensor,
    waits: Sequence[tf.Tensor],
    scope: str,
    ran: Sequence[tf.Operation] = (),
) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """`tensors`, each passed on, placed like it, once `after` and all of `waits` exist and
    the ops `ran` have run. Returns the passed tensors and what later ops are to read in
    place of `waits`.

    Outside XLA a tensor passes through a Slice of its whole extent (no copy) starting at a
    zero computed, at run time, from one element of `after`, and made after `waits`
    (control dependencies: when one of `waits` is done, the executor has nothing of ours to
    run, so it runs that tensor's other readers). Graph optimizers can neither fold that
    zero nor drop the dependency, as they drop identities, IdentityN outputs nobody reads and
    reshapes to a known shape. Inside an XLA-compiled function a tensor is passed on as
    itself minus a zero computed from one element of `after` and of each of `waits` (NOTE
    [gates under XLA]), except what follows from static shapes alone, which XLA needs as a
    compile-time constant (a reshape's target) and passes as it is; `waits` are returned as
    they are. XLA orders its own schedule and ignores `ran` (a data dependency would keep
    what it reads alive until the gate).
    """
    graph = tensors[0].graph
    with _tf.outside_caller_scopes(graph), graph.name_scope(scope):
        if _tf.compiled_by_xla(graph):
            with graph.device(after.op.device):
                zero = _xla_zero_computed_from([after, *waits])
            gated = [
                tensor if kernels.computed_from_shapes(tensor) else _minus_zero(tensor, zero)
                for tensor in tensors
            ]
        else:
            with graph.device(after.op.device), tf.control_dependencies([*waits, *ran]):
                zero = _zero_computed_from(after)
            starts: dict[int | None, tuple] = {}
            gated = [_passed_after(tensor, zero, starts) for tensor in tensors]
    for tensor, output in zip(tensors, gated, strict=True):
        output.set_shape(tensor.shape)
        _tf.copy_handle_data(tensor, output)
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
# them alive in XLA's temporary buffer (tests/test_xla.py measures the savings kept).


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
        with tf.control_dependencies([tensor.op]):
            return tf.identity(unseen, name="zero")
    first = tensor
    if rank:
        zeros, ones = _constant(tensor.graph, [0] * rank), _constant(tensor.graph, [1] * rank)
        first = tf.raw_ops.StridedSlice(input=tensor, begin=zeros, end=ones, strides=ones)
    if first.dtype.is_complex:
        first = tf.math.real(first)
    elif first.dtype == tf.bool:
        first = tf.cast(first, tf.int8)
    unequal = tf.cast(tf.less(first, first), tf.int64)
    return tf.add(
        tf.reduce_sum(unequal, _constant(tensor.graph, list(range(rank)))), unseen, name="zero"
    )


def _constant(graph: tf.Graph, value: int | list[int], dtype: tf.DType = tf.int64) -> tf.Tensor:
    """An integer constant of `graph`, made once and found again by its name (a cache outside
    the graph would hold the graph, and everything it captured, alive)."""
    values = value if isinstance(value, list) else [value]
    name = f"memory_saving_gradients_{dtype.name}_" + "_".join(str(v) for v in values)
    if not isinstance(value, list):
        name += "_scalar"
    return _made_once(graph, name, lambda: tf.constant(value, dtype, name=name))


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
        with _tf.outside_caller_scopes(graph):
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
        with tf.control_dependencies([zero]):
            return tf.raw_ops.Identity(input=tensor)


def opaque(tensor: tf.Tensor) -> tf.Tensor:
    """`tensor` itself (its buffer, no copy), passed through an op graph optimizers cannot see
    through: a slice of its whole extent from a zero they do not know (NOTE [products
    reassociated ahead] in `ordering.py`)."""
    starts: dict[int | None, tuple] = {}
    passed = _passed_after(tensor, _unfoldable_zero(tensor.graph), starts)
    passed.set_shape(tensor.shape)
    return passed


def _passed_after(tensor: tf.Tensor, zero: tf.Tensor, starts: dict) -> tf.Tensor:
    """`tensor`, read once `zero` exists: a slice from `zero` of the tensor's static size
    (the whole tensor, the same buffer) where slicing applies, an identity waiting for `zero`
    otherwise (resources, variants). `starts` shares the slices' starts, one per rank, placed
    like `zero`. The sizes tell graph optimizers the slice's shape, which they cannot infer
    from a start they do not know: with that shape they treat what reads the slice as they
    treat what reads the tensor (no ShapeN before a convolution's gradient, trees of adds
    made one AddN; ResNet50's recomputed ops: 53 ShapeN fewer)."""
    rank = tensor.shape.rank
    if tensor.dtype in (tf.resource, tf.variant) or rank is None:
        with placed_like(tensor), tf.control_dependencies([zero]):
            return tf.raw_ops.Identity(input=tensor)
    if rank not in starts:
        with tf.device(zero.op.device):
            # int32 dims: tf.vectorized_map vectorizes a Fill by prepending its int32 count
            starts[rank] = tf.fill(_constant(tensor.graph, [rank], tf.int32), zero)
    sizes = _constant(tensor.graph, [-1 if d is None else d for d in tensor.shape.as_list()])
    with placed_like(tensor):
        return tf.raw_ops.Slice(input=tensor, begin=starts[rank], size=sizes)


@contextlib.contextmanager
def placed_like(tensor: tf.Tensor) -> Iterator[None]:
    """Build ops on `tensor`'s device and in its colocation group, named after its op, as
    TensorFlow places what passes a tensor on (the caller's device and colocation scopes are
    left)."""
    with (
        tensor.graph.colocate_with(tensor.op, ignore_existing=True),
        tensor.graph.name_scope(tensor.op.name),
    ):
        yield
