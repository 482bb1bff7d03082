"""How TensorFlow runs a step around a view's ops: what the simulator and the rewrite need to
know beyond what a checkpointing policy decides on (`ForwardView`).

That is: which tensors the step makes outside the view for its ops, when the ops computed
from weights alone run, which forward ops have run once given gradients arrive, where
the gradients of the xs arrive (at the xs' variable reads), and which products of plain
backprop TensorFlow's optimizers move into the forward pass.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Sequence
from functools import cached_property

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import kernels, queries
from memory_saving_gradients._src.analysis.gradient_uses import GradientUse
from memory_saving_gradients._src.analysis.view import VARIABLE_READS, ForwardView, is_weight_value


class Execution:
    """How the executor runs the step a view is taken from (`execution_of` gives the one of
    a view). It holds its view weakly: kept per view, it would otherwise keep every view, and
    the graph of each, alive."""

    def __init__(self, view: ForwardView) -> None:
        self._view = weakref.ref(view)

    @property
    def view(self) -> ForwardView:
        view = self._view()
        assert view is not None, "a view's Execution is used only while the view is"
        return view

    @cached_property
    def made_outside(self) -> tuple[tf.Tensor, ...]:
        """Tensors the view's ops read that the step makes outside the view: a dropout's
        mask, drawn from a seed no x leads to, or a padding mask cast from the inputs. Not
        resident before the step and never recomputed, each is alive from the forward pass
        until its readers' gradients have read it. One of each set that identical ops compute
        (NOTE [identical ops are merged])."""
        return tuple(group[0] for group in self.made_outside_groups)

    @cached_property
    def made_outside_groups(self) -> tuple[tuple[tf.Tensor, ...], ...]:
        """Each of `made_outside` with the tensors identical ops compute, which the step
        holds in one buffer (NOTE [identical ops are merged])."""
        view = self.view
        found: dict[int, dict[object, tf.Tensor]] = {}
        computation = _Computations()
        for op in view.ops:
            for t in op.inputs:
                if (
                    t.op not in view.position
                    and not view.is_x(t)
                    and t.dtype not in (tf.resource, tf.variant)
                    and _allocated_in_step(t)
                ):
                    found.setdefault(computation.of(t), {}).setdefault(t.ref(), t)
        return tuple(tuple(group.values()) for group in found.values())

    @cached_property
    def remakeable(self) -> dict[object, tuple[tf.Operation, ...]]:
        """Of the tensors the view's ops read that the step makes outside the view (each of
        `made_outside` and those identical to one), by `ref()`, those backprop can make again
        where it recomputes their readers, with the ops that make them, in order (NOTE [masks
        made again]): not under XLA, which fuses the draw into its readers."""
        view = self.view
        if view.ys and _tf.compiled_by_xla(view.ys[0].graph):
            return {}
        found: dict[object, tuple[tf.Operation, ...]] = {}
        for op in view.ops:
            for t in op.inputs:
                if t.ref() in found or t.op in view.position or view.is_x(t):
                    continue
                if kernels.tensor_bytes(t) >= REMADE_FROM_BYTES and _allocated_in_step(t):
                    ops = _ops_remaking(t)
                    if ops is not None:
                        found[t.ref()] = ops
        return found

    def drawn_after(
        self, tensor: tf.Tensor, ops: frozenset[tf.Operation]
    ) -> tuple[tf.Operation, ...]:
        """The ops of `ops` (a recomputed segment's) whose copies the copies drawing
        `tensor` again (`remakeable`) wait for: those one before its first reader among
        `ops`, as weight ops wait (NOTE [weight ops wait for their readers]), so that the draw
        runs beside its readers, not as the step starts; none that `tensor` leads to."""
        view = self.view
        readers = sorted((op for op in tensor.consumers() if op in ops), key=view.order)
        if not readers:
            return ()
        made = [t.op for t in readers[0].inputs if t.op in ops]
        before = tuple(dict.fromkeys(t.op for op in made for t in op.inputs if t.op in ops))
        if set(before) & queries.forward_ops([tensor], ops):
            return ()
        return before

    @cached_property
    def products_ahead(self) -> dict[tf.Operation, tf.Tensor]:
        """For each op whose gradient ends by multiplying what it made of the arriving
        gradient by a forward tensor, where the op before it scales by a factor with fewer
        elements and no gradient of its own: that forward tensor, where plain backprop's
        `(g * tensor) * factor` becomes `g * (tensor * factor)`, as the names have it, and
        backprop reads the tensor otherwise too (NOTE [products ahead in plain backprop]).
        None under XLA, which decides the order itself, and inside TF1 while loops and
        conds, where the rewrite leaves the order to the optimizers too."""
        view = self.view
        if not view.ops or _tf.compiled_by_xla(view.ops[0].graph):
            return {}
        found = {}
        for op in view.ops:
            use = view.costs[op].gradient
            if use is None or _tf.in_v1_control_flow(op):
                continue
            for index, scaled in enumerate(op.inputs):
                if view.consumers(scaled) != [op] or not _scaled_by_a_factor(scaled, view):
                    continue
                tensor = _multiplied_last_and_read_otherwise(op, index, use, view)
                if tensor is not None and _multiplied_ahead_by_name(tensor):
                    found[op] = tensor
                    break
        return found

    @cached_property
    def weight_op_waits(self) -> dict[tf.Operation, tuple[tf.Operation, ...]]:
        """For each of the first `ForwardView.weight_ops` of a chain that one matmul or
        convolution past the chain reads, the ops it is to wait for: those making the inputs
        of the ops making that reader's other inputs (NOTE [weight ops wait for their
        readers]). Chains read by several ops are left free."""
        weights = self.view.weight_ops

        def made_by(op: tf.Operation) -> list[tf.Operation]:
            return [t.op for t in op.inputs if t.op not in weights and not is_weight_value(t)]

        waits = {}
        for op in self.view.ops:
            if op not in weights or any(t.op in weights for t in op.inputs):
                continue
            reader = _only_reader_past(op, weights)
            if reader is None or reader.type not in kernels.CONTRACTIONS:
                continue
            before = tuple(dict.fromkeys(w for maker in made_by(reader) for w in made_by(maker)))
            if before:
                waits[op] = before
        return waits

    @property
    def weight_ops_run_early(self) -> bool:
        """Whether the forward pass runs `ForwardView.weight_ops` as the step starts, not made
        to wait: in a tf.compat.v1 graph, whose ops a Session may have run already (NOTE
        [weight ops wait for their readers])."""
        ops = self.view.ops
        return bool(ops) and not ops[0].graph.building_function

    def reads_of(self, x: tf.Tensor) -> list[tf.Tensor]:
        """The floating-point outputs of the variable reads of `x` (a resource read, or the
        identity reading a TF1 reference variable), not recomputed: their gradients pass on
        to `x` unchanged. Other ops reading a variable (a gather, a function call capturing
        it) make gradients of their own."""
        view = self.view
        return [
            out
            for op in dict.fromkeys(view.consumers(x))
            if op not in view.recomputable and op.type in VARIABLE_READS
            for out in op.outputs
            if out.dtype.is_floating
        ]

    @cached_property
    def gradients_of_xs(self) -> tuple[tf.Tensor, ...]:
        """The tensors whose gradients are those of xs: the xs and their `reads_of`."""
        xs = self.view.xs
        return (*xs, *(out for x in xs for out in self.reads_of(x)))

    def forward_before_gradients(self, tensors: Sequence[tf.Tensor]) -> int:
        """The ops that have run once the gradients arriving at `tensors` exist, as a bitset
        of their positions: each forward value that a gradient on the way from the ys to
        `tensors` reads (`GradientUse.reads` of the input it flows into; an unknown gradient
        reads them all), and every op it is computed from. Backprop from a loss seeded with
        constants reaches an independent branch (one chain of `a + b`) before the forward
        pass of the other has run, and a mean's sum (a `div_no_nan` by the count, whose
        gradient for the sum reads the count alone) before the forward pass has made it."""
        below = self._forward_below
        return functools.reduce(operator.or_, (self._arriving_at(t, below) for t in tensors), 0)

    def forward_through(self, ops: Sequence[tf.Operation]) -> int:
        """The ops that have run once `ops` have, as a bitset of their positions: `ops` and
        every op they are computed from."""
        above = self._forward_above
        return functools.reduce(operator.or_, (above[op] for op in ops), 0)

    def _arriving_at(self, tensor: tf.Tensor, below: dict[tf.Operation, int]) -> int:
        """`forward_before_gradients` of `tensor`, given `below` for the ops reading it."""
        read = self._read_by_gradient
        return functools.reduce(
            operator.or_,
            (
                # .get: a TF1 loop's NextIteration feeds the Merge before it
                below.get(reader, 0) | read(reader, index)
                for reader in self.view.consumers(tensor)
                for index, input_ in enumerate(reader.inputs)
                if input_ is tensor
            ),
            0,
        )

    def _read_by_gradient(self, op: tf.Operation, index: int) -> int:
        """The forward ops that have run once `op`'s gradient for its input `index` exists:
        those making what that gradient reads, and what they are computed from."""
        above = self._forward_above
        use = self.view.costs[op].gradient
        if use is None:
            return above[op]
        inputs, outputs = use.reads[index]
        ran = functools.reduce(operator.or_, (above.get(op.inputs[i].op, 0) for i in inputs), 0)
        return ran | above[op] if outputs else ran

    @cached_property
    def _forward_above(self) -> dict[tf.Operation, int]:
        """For each op, the bitset of itself and every op it is computed from."""
        view = self.view
        above: dict[tf.Operation, int] = {}
        for op in view.ops:
            above[op] = functools.reduce(
                operator.or_,
                (above[t.op] for t in op.inputs if t.op in above),
                1 << view.position[op],
            )
        return above

    @cached_property
    def _forward_below(self) -> dict[tf.Operation, int]:
        """For each op, `forward_before_gradients` of its outputs (a TF1 loop's back edges
        left out)."""
        below: dict[tf.Operation, int] = {}
        for op in reversed(self.view.ops):
            below[op] = functools.reduce(
                operator.or_, (self._arriving_at(t, below) for t in op.outputs), 0
            )
        return below


_EXECUTIONS: weakref.WeakKeyDictionary[ForwardView, Execution] = weakref.WeakKeyDictionary()


def execution_of(view: ForwardView) -> Execution:
    """The `Execution` of `view`, made once per view: planning simulates many schedules of
    one view, and the rewrite asks at every step."""
    found = _EXECUTIONS.get(view)
    if found is None:
        found = _EXECUTIONS.setdefault(view, Execution(view))
    return found


# NOTE [weight ops wait for their readers]: an op computed from variables alone, such as
# the half-precision copy of a kernel Keras casts under a mixed-precision policy, is ready
# as soon as a step starts, and TensorFlow's executor runs every ready op: every kernel copy
# of a mixed-precision model is then held while its first blocks run, and each step
# recomputing a segment does the same at its gate (tests/test_memory.py, the kernel-cast
# tests). So the rewrite makes the first op of each chain a matmul or convolution reads wait
# (a control dependency) for the ops one before its reader: for what the ops making the
# reader's other inputs read. Not for those ops themselves, which graph
# optimizers may merge into the reader (oneDNN folds a Pad into the convolution reading it):
# the merged op would inherit the dependency and wait for its own input (a cycle). It waits
# in the forward pass where that runs in a function, and in every recomputed copy.
# A tf.compat.v1 graph's forward ops are left as they are, as a Session that has run them
# ignores changes to them (and warns); the simulator runs them first there. Chains read by
# several ops, and small weights read by other ops (biases, scales), are left free.
def _only_reader_past(op: tf.Operation, chain: frozenset[tf.Operation]) -> tf.Operation | None:
    """The one op past `chain` that reads what `op` starts, following ops of `chain` that
    each have one reader; None where some op on the way has another number of readers."""
    while True:
        readers = {reader for out in op.outputs for reader in out.consumers()}
        if len(readers) != 1:
            return None
        (op,) = readers
        if op not in chain:
            return op


# NOTE [identical ops are merged]: TensorFlow's graph optimizers merge ops of one type, with
# the same attributes and the same inputs, into one (grappler's common subexpression
# elimination), and then their readers, which have become identical too. A model that makes
# its attention mask in every block from the same padding mask (keras-hub's decoders each
# compare a causal mask with it) computes it once per step: one bool tensor of batch by
# length squared alive to the end of backprop, not one per block (tests/test_simulation.py).
# Ops with side effects (random draws, placeholders, variable reads) are never merged.
_NEVER_MERGED = frozenset(
    {"Placeholder", "PlaceholderWithDefault", "ReadVariableOp", "VarHandleOp"}
)


class _Computations:
    """A number for what computes each tensor, shared by tensors that identical ops compute
    from the same stateful ops and constants of the same value."""

    def __init__(self) -> None:
        self._of_tensor: dict[object, int] = {}
        self._of_computation: dict[tuple, int] = {}

    def of(self, tensor: tf.Tensor) -> int:
        """The number of `tensor`'s computation, its inputs' numbered first (without
        recursion: a mask may be computed by a long chain of ops)."""
        pending = [tensor]
        while pending:
            top = pending[-1]
            if top.ref() in self._of_tensor:
                pending.pop()
                continue
            mergeable = _mergeable(top.op)
            missing = [t for t in _inputs_and_waits(top.op) if t.ref() not in self._of_tensor]
            if mergeable and missing:
                pending.extend(missing)
                continue
            pending.pop()
            key = self._computation(top) if mergeable else (top.ref(),)
            number = self._of_computation.setdefault(key, len(self._of_computation))
            self._of_tensor[top.ref()] = number
        return self._of_tensor[tensor.ref()]

    def _computation(self, tensor: tf.Tensor) -> tuple:
        op = tensor.op
        attributes = tuple(
            (name, op.node_def.attr[name].SerializeToString(deterministic=True))
            for name in sorted(op.node_def.attr)
            if not name.startswith("_")
        )
        inputs = tuple(self._of_tensor[t.ref()] for t in op.inputs)
        waits = frozenset(
            self._of_tensor[c.outputs[0].ref()] if c.outputs else c for c in op.control_inputs
        )
        return (op.type, op.device, attributes, tensor.value_index, inputs, waits)


def _mergeable(op: tf.Operation) -> bool:
    """Whether graph optimizers may merge `op` with an identical op (NOTE [identical ops are
    merged])."""
    return not (_tf.is_stateful(op) or op.type in _NEVER_MERGED or _tf.in_v1_control_flow(op))


def _inputs_and_waits(op: tf.Operation) -> list[tf.Tensor]:
    """The tensors `op` reads, and the first output of each op it waits for that has one."""
    return [*op.inputs, *(c.outputs[0] for c in op.control_inputs if c.outputs)]


def _allocated_in_step(tensor: tf.Tensor) -> bool:
    """Whether `tensor` takes a buffer of its own while a step runs: its op has inputs, is no
    variable read, and is no alias (an identity, a reshape) of what was there before."""
    while tensor.op.type in kernels.ALIASING and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    op = tensor.op
    return bool(op.inputs) and op.type not in kernels.RESIDENT and not is_weight_value(tensor)


# NOTE [masks made again]: a dropout's mask is drawn outside the view, from a seed no x leads
# to, and backprop reads it where it differentiates the select that applied it: held from the
# forward pass to there, one mask of batch by heads by length squared per attention block
# (Keras's attention dropout, keras-hub's GPT-2), whatever the plan recomputes. Keras draws it
# with stateless random ops, which give the same bits from the same key and counter: a step
# recomputing the select can draw the mask again from those few bytes, so the forward pass
# lets it go once its forward readers have run. A tensor is made again where every op making
# it (back to constants, the step's inputs, and tensors of at most `REMADE_FROM_SMALL_BYTES`,
# read as they were made) is stateless, reads no resource and is in no TF1 control flow: a
# draw of `tf.random.uniform` (stateful) or a mask read from a variable stays held.
#: Tensors made outside the view of fewer bytes are held, not made again.
REMADE_FROM_BYTES = 1 << 16
#: Tensors of at most this many bytes are read as the forward pass made them (keys, counters,
#: shapes): what a mask is made again from.
REMADE_FROM_SMALL_BYTES = 1 << 10
#: Op types that hold a function or control flow: never made again.
_NOT_REMADE = frozenset(
    {"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While",
     "StatelessWhile", "Case", "StatelessCase"}
)  # fmt: skip
_INPUTS = frozenset({"Placeholder", "Const"})


def _ops_remaking(tensor: tf.Tensor) -> tuple[tf.Operation, ...] | None:
    """The ops making `tensor` again, in topological order, from what they read that is
    resident or small; None where one of them may not run twice (NOTE [masks made again])."""
    ops: dict[tf.Operation, None] = {}
    pending = [tensor.op]
    while pending:
        op = pending.pop()
        if op in ops:
            continue
        if (
            _tf.is_stateful(op)
            or op.type in _NOT_REMADE
            or op.control_inputs
            or _tf.in_v1_control_flow(op)
            or any(t.dtype in (tf.resource, tf.variant) for t in op.inputs)
        ):
            return None
        ops[op] = None
        pending.extend(
            t.op
            for t in op.inputs
            if t.op.type not in _INPUTS
            and not (
                t.shape.is_fully_defined() and kernels.tensor_bytes(t) <= REMADE_FROM_SMALL_BYTES
            )
        )
    return tuple(sorted(ops, key=_tf.creation_index))


# NOTE [products ahead in plain backprop]: TensorFlow's graph optimizers reassociate a chain
# of products so that a factor with fewer elements is multiplied first; which of two operands
# of one size goes with it follows their names. Plain backprop's `(g * tensor) * factor` (a
# softmax's gradient met by that of the scaling before it, as `keras.ops.
# dot_product_attention` scales its logits; a GELU's `(0.5 * x) * erfc(...)`) becomes
# `g * (tensor * factor)` in a function's graph where the forward tensor's name sorts before
# the gradients' (`gradients/...` for `tf.gradients`, `gradient_tape/...` for a tape, as
# Keras's step has): a functional Keras model's tensors (`functional_1/...`) or a function's
# own ops (`Softmax`), not layers called under a later name (`multi_head_attention/...`). In
# a Session's graph the order is the mirror: where the forward name sorts after the
# gradients' (tests/test_gradient_options.py, tests/test_memory.py). `tensor * factor`,
# reading no gradient, runs as soon as the tensor exists and is held until the op's gradient
# reads it: one more tensor of its size where backprop reads the tensor too (a softmax's
# gradient reads it twice, the attention product's once), none where the product replaces it
# (a GELU's erfc). The rewrite's gradients keep the order (NOTE [products reassociated
# ahead] in `_src/rewriting/ordering.py`), so this is plain backprop's alone.
def _multiplied_ahead_by_name(tensor: tf.Tensor) -> bool:
    """Whether `tensor`'s name puts the product of it and a factor ahead of backprop (NOTE
    [products ahead in plain backprop])."""
    name = tensor.op.name if tensor.value_index == 0 else tensor.name
    before = name < "gradients"
    return before if tensor.graph.building_function else not before


def _scaled_by_a_factor(tensor: tf.Tensor, view: ForwardView) -> bool:
    """Whether the view's op making `tensor` multiplies or divides by a factor known to have
    fewer elements than `tensor` and no gradient."""
    op = tensor.op
    if op not in view.position:
        return False
    for index in kernels.REASSOCIATED_PRODUCTS.get(op.type, ()):
        factor = op.inputs[1 - index]
        gets_gradient = factor.op in view.position or view.is_x(factor)
        if not gets_gradient and kernels.fewer_elements(factor, tensor):
            return True
    return False


def _multiplied_last_and_read_otherwise(
    op: tf.Operation, index: int, use: GradientUse, view: ForwardView
) -> tf.Tensor | None:
    """The forward tensor of `op` that its gradient for input `index` multiplies by in its
    last step, where another step of that gradient or another op's gradient reads it too
    (None otherwise)."""
    returned = use.returned[index]
    last = next((s for s in use.steps if returned in s.outputs), None)
    if last is None or last.kind != "Mul" or len(last.reads) != 2:
        return None
    captured = {placeholder: (kind, i) for placeholder, kind, i in use.captured}
    forward = [t for t in last.reads if t in captured]
    if len(forward) != 1:
        return None
    kind, i = captured[forward[0]]
    tensor = (op.inputs if kind == "in" else op.outputs)[i]
    if any(s is not last and forward[0] in s.reads for s in use.steps):
        return tensor
    return tensor if _read_by_other_gradients(tensor, op, view) else None


def _read_by_other_gradients(tensor: tf.Tensor, op: tf.Operation, view: ForwardView) -> bool:
    """Whether the gradient of an op of the view other than `op` reads `tensor`."""
    maker = tensor.op
    if maker is not op and maker in view.position:
        cost = view.costs[maker]
        if any(maker.outputs[i] is tensor for i in cost.saved_outputs):
            return True
    for reader in view.consumers(tensor):
        if reader is not op:
            cost = view.costs[reader]
            if any(reader.inputs[i] is tensor for i in cost.saved_inputs):
                return True
    return False
