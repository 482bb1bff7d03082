"""A view's tensors and ops as integers, which the simulator walks many times over."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import tensorflow as tf

from memory_saving_gradients._src.analysis import costs
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning.simulation import executor

#: The numbering of each view alive, by the view's `id`: a view holds tensors, which inside a
#: tf.function do not hash.
_NUMBERINGS: dict[int, Numbering] = {}


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
      gradient_kernels: for each op, the kernels of its gradient that run apart
        (`gradient_uses.GradientUse.kernels`), timed and waited for (`executor.Kernel`): one,
        perhaps making nothing, where its gradient is unknown or one kernel makes all.
      kernel_inputs: for each op, the inputs (by index) whose gradients each of its
        `gradient_kernels` makes.
      gradient_reads: the ids each op's gradient reads (`costs.OpCost`), each once, by
        position.
      kernel_reads: for each op of more than one of `gradient_kernels`, the ids of its
        tensors each kernel reads (`gradient_uses.GradientUse.reads`); empty for the others.
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
    gradient_kernels: tuple[tuple[executor.Kernel, ...], ...]
    kernel_inputs: tuple[tuple[tuple[int, ...], ...], ...]
    gradient_reads: tuple[tuple[int, ...], ...]
    kernel_reads: tuple[tuple[frozenset[int], ...], ...]
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
        gradient_reads, kernels, kernel_inputs, kernel_reads = [], [], [], []
        for op, ins, outs in zip(view.ops, inputs, outputs, strict=True):
            cost = view.costs[op]
            wanted = [
                needed and receives_gradient[t] for t, needed in zip(ins, cost.needed, strict=True)
            ]
            groups = cost.gradient.kernels(wanted) if cost.gradient is not None else ()
            if len(groups) < 2:
                groups = (tuple(i for i, want in enumerate(wanted) if want),)
            kernel_inputs.append(groups)
            kernel_reads.append(
                tuple(
                    frozenset(ins[j] for i in group for j in cost.gradient.reads[i][0])
                    | frozenset(outs[j] for i in group for j in cost.gradient.reads[i][1])
                    for group in groups
                )
                if len(groups) > 1 and cost.gradient is not None
                else ()
            )
            waited_for = (
                cost.gradient.kernels_waited_for(groups)
                if len(groups) > 1 and cost.gradient is not None
                else ((),) * len(groups)
            )
            kernels.append(
                tuple(
                    executor.Kernel(
                        seconds, tuple(maker[ins[i]] for i in group if ins[i] in maker), after
                    )
                    for group, seconds, after in zip(
                        groups, kernel_seconds(cost, groups), waited_for, strict=True
                    )
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
            kernel_inputs=tuple(kernel_inputs),
            gradient_reads=tuple(gradient_reads),
            kernel_reads=tuple(kernel_reads),
            gradient_parts=tuple(parts),
        )


def kernel_seconds(cost: costs.OpCost, groups: Sequence[Sequence[int]]) -> list[float]:
    """How long the kernels making the gradients of each of the input `groups` of `cost`'s
    gradient run: as measured, by their steps' names; else their share of the gradient's
    time (measured, or twice its op's compute), shared by the groups that compute something
    (a gradient passed on unchanged is ready at once)."""
    total = cost.gradient_seconds or 2.0 * cost.compute
    use = cost.gradient
    if len(groups) < 2 or use is None:
        return [total] * len(groups)
    steps = [set().union(*(use.needs[i] for i in group)) for group in groups]
    if cost.gradient_kernel_seconds:
        measured = dict(cost.gradient_kernel_seconds)
        seconds = [sum(measured.get(use.steps[s].name, 0.0) for s in ran) for ran in steps]
        if any(seconds):
            return seconds
    computing = [any(use.steps[s].computes for s in ran) for ran in steps]
    if not any(computing):
        computing = [True] * len(groups)
    share = total / sum(computing)
    return [share if computes else 0.0 for computes in computing]
