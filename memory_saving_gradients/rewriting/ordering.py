"""The order of the ops one gradient call made: which weight gradients run before the data
gradients beside them (NOTE [weight gradients first])."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import tensorflow as tf

from memory_saving_gradients import _tf
from memory_saving_gradients.analysis import kernels


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
# the longer the earlier it runs: an Inception block's 'speed' peak 2 MiB higher). A
# residual CNN's 'speed' step took 1.18x plain's with every weight gradient first and
# 1.04-1.07x so, at the same peak. Matrix products keep the order: left free on the demo's
# chain of 256-wide tanh layers, their weight gradients fell behind the data gradients'
# chain, each holding its activation ('memory' at depth 32: 17.2 MiB against 14.2), and on
# a chain of 1024-wide ones a gradient more.
def weight_gradients_first(
    part_ops: Collection[tf.Operation], made: Sequence[tf.Operation]
) -> None:
    """Order the ops making weight-gradient parts (`part_ops`) among the ops one gradient
    call `made` (NOTE [weight gradients first])."""
    position = {op: i for i, op in enumerate(made)}  # TensorFlow makes ops after their inputs
    for op in part_ops:
        siblings = {
            reader
            for t in op.inputs
            if t.op in position
            for reader in t.consumers()
            if reader in position and reader not in part_ops
        }
        if _may_lag(op, siblings, position):
            continue
        for reader in siblings:
            if not _reaches(reader, op, position):
                _tf.add_control_inputs(reader, [op])


def _may_lag(gradient: tf.Operation, siblings: set[tf.Operation], position: dict) -> bool:
    """Whether the weight `gradient`, a filter gradient, may run beside its `siblings` (ops of
    `position`): another of them holds what it reads from outside (the forward pass's tensors
    and their copies) for more than its shape, and it makes less than each sibling, whose
    output goes straight on."""
    if gradient.type not in _FILTER_GRADIENTS:
        return False
    held_anyway = any(
        reader in position and reader is not gradient and reader.type not in kernels.SHAPE_READERS
        for t in gradient.inputs
        if t.op not in position
        for reader in t.consumers()
    )
    made = sum(kernels.tensor_bytes(t) for t in gradient.outputs)
    return held_anyway and all(
        made < sum(kernels.tensor_bytes(t) for t in sibling.outputs)
        and _goes_straight_on(sibling, position)
        for sibling in siblings
    )


def _goes_straight_on(gradient: tf.Operation, position: dict) -> bool:
    """Whether what `gradient` makes is read by ops of `position` that wait for nothing else
    of theirs but what `gradient` itself waited for (a sum with the gradients of other
    branches would hold it the longer the earlier it runs)."""
    return all(
        t.op not in position
        or t.op is gradient
        or t.op.type in _GIVEN_AHEAD
        or _reaches(t.op, gradient, position)
        for out in gradient.outputs
        for reader in out.consumers()
        if reader in position
        for t in reader.inputs
    )


#: Convolutions' weight gradients measured to keep up beside their data gradients (the
#: residual CNN, ResNet50, the U-Net, Inception, DenseNet121, MobileNetV2).
_FILTER_GRADIENTS = frozenset({"Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter"})
#: Ops whose values are ready before the gradients reading them: shapes and constants.
_GIVEN_AHEAD = kernels.SHAPE_OF | {"Const"}


def _reaches(start: tf.Operation, end: tf.Operation, position: dict) -> bool:
    """Whether `end` reads, through ops of `position`, what `start` makes."""
    if position[start] > position[end]:
        return False
    seen, stack = set(), [start]
    while stack:
        op = stack.pop()
        if op is end:
            return True
        if op in seen:
            continue
        seen.add(op)
        stack.extend(
            reader
            for t in op.outputs
            for reader in t.consumers()
            if reader in position and position[reader] <= position[end]
        )
    return False
