"""A view's tensors and ops as integers, which the simulator walks many times over."""

from __future__ import annotations

import dataclasses
import weakref
from typing import NamedTuple

import tensorflow as tf

from memory_saving_gradients.analysis.view import ForwardView

#: The numbering of each view alive, by the view's `id`: a view holds tensors, which inside a
#: tf.function do not hash.
_NUMBERINGS: dict[int, Numbering] = {}


class GradientKernels(NamedTuple):
    """Kernels of an op's gradient that run apart from the others
    (`costs.GradientUse.kernels`): the inputs, by index, whose gradients they make, and the
    ops making those inputs, once per input: their gradients wait for these kernels."""

    inputs: tuple[int, ...]
    makers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Numbering:
    """A view's tensors as integers, for what walks one view many times (the cost model
    simulates every candidate plan): ints hash and compare faster than tensors' refs.

    Attributes:
      tensors: each tensor the view's ops read or make, and the xs and ys, by its id.
      ids: the id of each of `tensors`, by `ref()`.
      inputs, outputs: the ids of each op's inputs and outputs, by its position in `ops`.
      xs: the ids of the xs.
      receives_gradient: for each id, whether backprop makes a gradient for it: it is made
        by an op of the view or is an x.
      open: the ids of the tensors whose static shape is not fully known.
      readers: for each id, how many ops of the view read it.
      gradient_kernels: for each op, the kernels of its gradient (`GradientKernels`): one,
        perhaps making nothing, where its gradient is unknown or one kernel makes all.
      gradient_reads: the ids each op's gradient reads (`costs.OpCost`), each once, by
        position.
      gradient_parts: for each id, how many ops' gradients make a part of its gradient.
    """

    tensors: tuple[tf.Tensor, ...]
    ids: dict[object, int]
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    xs: frozenset[int]
    receives_gradient: tuple[bool, ...]
    open: frozenset[int]
    readers: tuple[int, ...]
    gradient_kernels: tuple[tuple[GradientKernels, ...], ...]
    gradient_reads: tuple[tuple[int, ...], ...]
    gradient_parts: tuple[int, ...]

    @classmethod
    def of(cls, view: ForwardView) -> Numbering:
        """The numbering of `view`, made once per view (the planner simulates many candidate
        plans of one) and forgotten with it."""
        key = id(view)
        numbering = _NUMBERINGS.get(key)
        if numbering is None:
            numbering = _NUMBERINGS[key] = cls._number(view)
            weakref.finalize(view, _NUMBERINGS.pop, key, None)
        return numbering

    @classmethod
    def _number(cls, view: ForwardView) -> Numbering:
        ids: dict[object, int] = {}
        tensors: list[tf.Tensor] = []

        def number(tensor: tf.Tensor) -> int:
            ref = tensor.ref()
            if ref not in ids:
                ids[ref] = len(tensors)
                tensors.append(tensor)
            return ids[ref]

        xs = frozenset(number(x) for x in view.xs)
        inputs, outputs = [], []
        for op in view.ops:
            inputs.append(tuple(number(t) for t in op.inputs))
            outputs.append(tuple(number(t) for t in op.outputs))
        for y in view.ys:
            number(y)
        maker = {t: position for position, ts in enumerate(outputs) for t in ts}
        receives_gradient = tuple(i in maker or i in xs for i in range(len(tensors)))
        readers, parts = [0] * len(tensors), [0] * len(tensors)
        gradient_reads, kernels = [], []
        for op, ins, outs in zip(view.ops, inputs, outputs, strict=True):
            cost = view.costs[op]
            wanted = [
                needed and receives_gradient[t] for t, needed in zip(ins, cost.needed, strict=True)
            ]
            groups = cost.gradient.kernels(wanted) if cost.gradient is not None else ()
            if len(groups) < 2:
                groups = (tuple(i for i, want in enumerate(wanted) if want),)
            kernels.append(
                tuple(
                    GradientKernels(group, tuple(maker[ins[i]] for i in group if ins[i] in maker))
                    for group in groups
                )
            )
            for t in set(ins):
                readers[t] += 1
            for t, want in zip(ins, wanted, strict=True):
                parts[t] += want
            read = [ins[i] for i in cost.saved_inputs] + [outs[i] for i in cost.saved_outputs]
            gradient_reads.append(tuple(dict.fromkeys(read)))
        return cls(
            tensors=tuple(tensors),
            ids=ids,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            xs=xs,
            receives_gradient=receives_gradient,
            open=frozenset(i for i, t in enumerate(tensors) if not t.shape.is_fully_defined()),
            readers=tuple(readers),
            gradient_kernels=tuple(kernels),
            gradient_reads=tuple(gradient_reads),
            gradient_parts=tuple(parts),
        )
