"""Graph editing for TensorFlow 2: copy a set of ops.

This is the part of TF1's `tf.contrib.graph_editor` that checkpointing needs. Copies are plain
new ops of the same graph; nothing existing is modified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf


def copy_ops(
    ops: Sequence[tf.Operation],
    scope: str,
    replacements: Mapping[object, tf.Tensor] | None = None,
    earlier: Mapping[tf.Operation, tf.Operation] | None = None,
    stand_in: Callable[[tf.Operation, tf.Operation], tf.Tensor | None] | None = None,
    waits: Mapping[tf.Operation, Sequence[tf.Operation]] | None = None,
) -> dict[tf.Operation, tf.Operation]:
    """Copy `ops`, given in topological order, and return a map from each op to its copy.

    A copy reads the copy of an input's producer when that producer is copied too, else the
    input's entry in `replacements` (keyed by `tensor.ref()`), else the output of an
    `earlier` copy of its producer (copies of copies are made from the originals), else the
    original input; control inputs are mapped like producers. Each copy keeps its original's
    type, attributes, device, colocation and static shapes, and is named `scope + original
    name` (made unique). Where `stand_in(op, copy)` gives a tensor, the copies made after it
    read that tensor instead of the copy's (one) output. Once all are made, the copy of each
    op `waits` lists waits for the ops it gives, mapped the same way (they may come later in
    the order: an op waits for what its reader reads).
    """
    replacements = replacements or {}
    earlier = earlier or {}
    waits = waits or {}
    copies: dict[tf.Operation, tf.Operation] = {}
    stood_in: dict[object, tf.Tensor] = {}

    def latest(op: tf.Operation) -> tf.Operation:
        if op.outputs and op.outputs[0].ref() in stood_in:
            return stood_in[op.outputs[0].ref()].op
        return copies.get(op) or earlier.get(op, op)

    if not ops:
        return {}
    with _tf.copying(ops[0].graph) as copy_op:
        for op in ops:
            inputs = [
                stood_in[t.ref()]
                if t.ref() in stood_in
                else replacements[t.ref()]
                if t.op not in copies and t.ref() in replacements
                else latest(t.op).outputs[t.value_index]
                for t in op.inputs
            ]
            copy = copy_op(op, inputs, scope + op.name)
            waited = waits.get(op, ())
            _tf.add_control_inputs(copy, [latest(c) for c in op.control_inputs if c not in waited])
            copies[op] = copy
            if stand_in is not None and (tensor := stand_in(op, copy)) is not None:
                stood_in[op.outputs[0].ref()] = tensor
    for op, copy in copies.items():
        _tf.add_control_inputs(copy, [latest(c) for c in waits.get(op, ())])
    return copies
