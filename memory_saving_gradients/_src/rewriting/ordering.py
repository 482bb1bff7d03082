"""The order of the backward pass's ops: which weight gradients of one gradient call run before
the data gradients beside them (NOTE [weight gradients first]), products of gradients kept from
being reordered into the forward pass (NOTE [products reassociated ahead]), and the gradients
of the xs passed on only once the reads of their variables have run (NOTE [updates after
reads])."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import kernels, queries
from memory_saving_gradients._src.analysis.arguments import Gradient
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.rewriting import gates


# NOTE [weight gradients first]: a weight gradient (a Conv2DBackpropFilter) reads an
# activation and the gradient arriving at its op; the data gradient beside it (a
# Conv2DBackpropInput) reads the same arriving gradient and makes a new tensor the size of
# that activation. Run in that order, the activation is freed before its gradient exists;
# the executor, left free, sometimes runs the data gradient first and lets the weight
# gradient lag, holding both (a U-Net's peak varied by a third between processes). So each
# weight gradient part runs before the other readers of the gradients it reads that its call
# made, unless such a reader is its ancestor (a part summing two gradients reads one of them
# and the other's producer). The order serializes what plain backprop runs side by side on
# the executor's threads, so a convolution's filter gradient is left free where its lag
# measured nothing: where another gradient holds the activation anyway (a ReLU's reads its
# output), the filter gradient is smaller than the data gradient, and the data gradient's
# reader waits for nothing else (not a sum with other branches' gradients, which holds it
# the longer the earlier it runs). Serializing every convolution's filter gradient costs
# time at the same peak (`bench --suite fit` times the residual CNN's 'speed').
# Matrix products keep the order: left free, their weight gradients fall behind the data
# gradients' chain, each holding its activation (tests/test_memory.py, the
# weight-gradients-first tests).
def weight_gradients_first(
    part_ops: Collection[tf.Operation], made: Sequence[tf.Operation]
) -> None:
    """Order the ops making weight-gradient parts (`part_ops`) among the ops one gradient
    call `made` (NOTE [weight gradients first])."""
    order = _Order(made)
    for op in part_ops:
        siblings = {
            reader
            for t in op.inputs
            if t.op in order
            for reader in t.consumers()
            if reader in order and reader not in part_ops
        }
        if _may_lag(op, siblings, order):
            continue
        for reader in siblings:
            if not order.reaches(reader, op):
                _tf.add_control_inputs(reader, [op])
                order.add_edge(op, reader)


class _Order:
    """The ops one gradient call made, in an order every edge between them follows: data
    edges, control edges (`gate_gradients` groups an op's input gradients behind one
    `group_deps`) and the waits added here. The order starts as the order of making, but for
    ops waiting on ops made after them (NOTE [a product's gradient frees before it makes] in
    analysis/gradient_functions.py); an added wait that goes against it moves the ops
    between its two ends as little as keeps every edge forward (Pearce and Kelly's dynamic
    topological order). So `reaches` searches only between the two ops' places."""

    def __init__(self, made: Sequence[tf.Operation]) -> None:
        made = queries.topological_order(made, control_inputs=True)
        self._place = {op: i for i, op in enumerate(made)}
        self._readers: dict[tf.Operation, list[tf.Operation]] = {op: [] for op in made}
        self._waited_for: dict[tf.Operation, list[tf.Operation]] = {op: [] for op in made}
        for op in made:
            for before in {*(t.op for t in op.inputs), *op.control_inputs}:
                if before in self._place:
                    self._readers[before].append(op)
                    self._waited_for[op].append(before)

    def __contains__(self, op: tf.Operation) -> bool:
        return op in self._place

    def reaches(self, start: tf.Operation, end: tf.Operation) -> bool:
        """Whether `end` waits, through edges between made ops, for `start`."""
        return end in self._between(
            start, self._readers, lambda op: self._place[op] <= self._place[end]
        )

    def add_edge(self, before: tf.Operation, after: tf.Operation) -> None:
        """Record that `after` now waits for `before` (which must not wait for `after`)."""
        self._readers[before].append(after)
        self._waited_for[after].append(before)
        low, high = self._place[after], self._place[before]
        if low > high:
            return
        ahead = self._between(after, self._readers, lambda op: self._place[op] <= high)
        behind = self._between(before, self._waited_for, lambda op: self._place[op] >= low)
        moved = sorted(behind, key=self._place.__getitem__) + sorted(
            ahead, key=self._place.__getitem__
        )
        for op, place in zip(moved, sorted(self._place[op] for op in moved), strict=True):
            self._place[op] = place

    @staticmethod
    def _between(
        start: tf.Operation,
        edges: Mapping[tf.Operation, Sequence[tf.Operation]],
        within: Callable[[tf.Operation], bool],
    ) -> set[tf.Operation]:
        """The ops reached from `start` along `edges`, through ops `within` allows."""
        seen, stack = set(), [start]
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            stack.extend(next_op for next_op in edges[op] if within(next_op))
        return seen


def _may_lag(gradient: tf.Operation, siblings: set[tf.Operation], order: _Order) -> bool:
    """Whether the weight `gradient`, a filter gradient, may run beside its `siblings` (ops of
    `order`): another of them holds what it reads from outside (the forward pass's tensors
    and their copies) for more than its shape, and it makes less than each sibling, whose
    output goes straight on."""
    if gradient.type not in _FILTER_GRADIENTS:
        return False
    held_anyway = any(
        reader in order and reader is not gradient and reader.type not in kernels.SHAPE_READERS
        for t in gradient.inputs
        if t.op not in order
        for reader in t.consumers()
    )
    made = sum(kernels.tensor_bytes(t) for t in gradient.outputs)
    return held_anyway and all(
        made < sum(kernels.tensor_bytes(t) for t in sibling.outputs)
        and _goes_straight_on(sibling, order)
        for sibling in siblings
    )


def _goes_straight_on(gradient: tf.Operation, order: _Order) -> bool:
    """Whether what `gradient` makes is read by ops of `order` that wait for nothing else
    of theirs but what `gradient` itself waited for (a sum with the gradients of other
    branches would hold it the longer the earlier it runs)."""
    return all(
        t.op not in order
        or t.op is gradient
        or t.op.type in _GIVEN_AHEAD
        or order.reaches(t.op, gradient)
        for out in gradient.outputs
        for reader in out.consumers()
        if reader in order
        for t in reader.inputs
    )


#: Convolutions' weight gradients measured to keep up beside their data gradients (the
#: residual CNN, ResNet50, the U-Net, Inception, DenseNet121, MobileNetV2).
_FILTER_GRADIENTS = frozenset({"Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter"})
#: Ops whose values are ready before the gradients reading them: shapes and constants.
_GIVEN_AHEAD = kernels.SHAPE_OF | {"Const"}


# NOTE [products reassociated ahead]: TensorFlow's graph optimizers reorder a chain of
# products so that the operands with fewer elements are multiplied first (the arithmetic
# optimizer's broadcast minimisation; constant folding pushes a constant factor down the same
# way). Where a gradient multiplies a product of a gradient and a forward tensor by a smaller
# factor, `(g * softmax) * scale` (a softmax's gradient met by that of the scaling before it,
# as `keras.ops.dot_product_attention` scales its logits), it becomes `g * (softmax *
# scale)` where the names have it so (NOTE [products ahead in plain backprop] in
# `_src/analysis/execution.py`), and `softmax * scale`, reading no gradient,
# runs as soon as the softmax exists: in the forward pass, or as a step's recomputation
# starts. That tensor, as large as the attention scores, is then held until backprop reaches
# it, one more such matrix per block than backprop needs (a Keras encoder without attention
# dropout, tests/test_memory.py). So in the rewrite's gradients the multiplication by the
# smaller factor reads the product through `gates.opaque`, which the optimizers cannot see
# through, and the simulator counts the tensor for `tf.gradients` alone. Not under XLA,
# whose own passes decide there, nor inside a TF1 while loop or cond, whose frames the pass
# would have to enter.
def products_kept_in_order(
    made: Sequence[tf.Operation], arriving: Sequence[tf.Tensor | None]
) -> None:
    """Keep the products of gradients that one gradient call `made` (from the gradients
    `arriving`, None where none arrives) in the order it made them (NOTE [products
    reassociated ahead])."""
    if not made or _tf.compiled_by_xla(made[0].graph):
        return
    ours = set(made)
    gradients = {t.ref() for t in arriving if t is not None}
    for op in made:
        if _tf.in_v1_control_flow(op):  # a pass built outside its frame could not read it
            continue
        for index in kernels.REASSOCIATED_PRODUCTS.get(op.type, ()):
            product, factor = op.inputs[index], op.inputs[1 - index]
            if (
                product.op in ours
                and product.op.type == "Mul"
                and kernels.fewer_elements(factor, product)
                and any(t.op not in ours and t.ref() not in gradients for t in product.op.inputs)
            ):
                _tf.replace_input(op, index, gates.opaque(product))
                break


# NOTE [updates after reads]: an optimizer updating a variable in the step runs as soon as its
# gradient exists, and a weight gradient exists before the data gradient beside it (NOTE
# [weight gradients first]), which still reads the variable's value. A variable whose buffer
# is still read cannot be updated in place: TensorFlow copies it to a new buffer (15 of 16
# updates of an SGD step on a 16-layer chain), a transient the size of the variable, and the
# variables move in memory every step, so the allocator's free blocks, and its peak, differ
# from step to step. So each x's gradient is passed on only once every op of this backward
# pass reading x's value (directly, or through a gate) has run.
def released_after_reads(
    view: ForwardView,
    gradients: list[Gradient | None],
    passed: dict,
    scope: str,
    placement: dict[object, tf.Tensor],
    stand_in: Callable[[tf.Tensor], tf.Tensor],
) -> list[Gradient | None]:
    """`gradients` of `view.xs`, each passed on once the ops under `scope` reading its x (or
    the variable read of x, or a gate passing either on: `stand_in` of either, and the
    gates in `passed` by the ref of what they pass) have run, and placed like the
    gradient that arrived at x's first variable read (`placement`, by ref) where x has one:
    a read passes its gradient on unchanged, so that is where TensorFlow's is. The step
    passing gradients into reads runs uncolocated (variable reads may have no device)."""
    released = []
    for x, gradient in zip(view.xs, gradients, strict=True):
        readers = {
            reader
            for tensor in (x, *execution_of(view).reads_of(x))
            for alias in (stand_in(tensor), *passed.get(tensor.ref(), ()))
            for reader in alias.consumers()
            if reader.name.startswith(scope) and not _tf.in_v1_control_flow(reader)
        }
        like = placement.get(x.ref())
        if gradient is None or not (readers or like is not None):
            released.append(gradient)
            continue
        with tf.control_dependencies(sorted(readers, key=lambda op: op.name)):
            released.append(
                tf.nest.map_structure(
                    lambda t, like=like: _passed_on(t, like), gradient, expand_composites=True
                )
            )
    return released


def _passed_on(tensor: tf.Tensor, like: tf.Tensor | None = None) -> tf.Tensor:
    """An identity of `tensor`, placed and colocated like it, or like `like`."""
    with gates.placed_like(tensor if like is None else like):
        return tf.identity(tensor)
