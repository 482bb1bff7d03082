"""Graph editing for TensorFlow 2: copy a set of ops and order the copies.

This is the part of TF1's `tf.contrib.graph_editor` that checkpointing needs. Copies are plain
new ops of the same graph; nothing existing is modified except by `add_control_inputs`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import tensorflow as tf

from memory_saving_gradients import _tf


def copy_ops(
    ops: Sequence[tf.Operation],
    scope: str,
    replacements: Mapping[object, tf.Tensor] | None = None,
) -> dict[tf.Operation, tf.Operation]:
    """Copy `ops`, given in topological order, and return a map from each op to its copy.

    A copy reads the copy of an input's producer when that producer is copied too, else the
    input's entry in `replacements` (keyed by `tensor.ref()`), else the original input;
    control inputs are mapped like producers. Each copy keeps its original's type,
    attributes, device, colocation and static shapes, and is named `scope + original name`
    (made unique).
    """
    replacements = replacements or {}
    copies: dict[tf.Operation, tf.Operation] = {}
    for op in ops:
        inputs = [
            copies[t.op].outputs[t.value_index] if t.op in copies else replacements.get(t.ref(), t)
            for t in op.inputs
        ]
        copy = _tf.copy_op(op, inputs, name=scope + op.name)
        _tf.add_control_inputs(copy, (copies.get(c, c) for c in op.control_inputs))
        copies[op] = copy
    return copies


def private_input(tensor: tf.Tensor, scope: str) -> tf.Tensor:
    """An identity of `tensor` (the same buffer, no copy) for some copies to read in its place,
    placed like `tensor`; nothing else reads it."""
    return _tf.identity_like(tensor, name=scope + tensor.op.name)


def add_control_inputs(ops: Iterable[tf.Operation], wait_for: Sequence[tf.Operation]) -> None:
    """Make every op of `ops` wait until all of `wait_for` have run."""
    for op in ops:
        _tf.add_control_inputs(op, wait_for)
