"""Checkpointed backprop: differentiate the forward pass step by step, recomputing each segment.

A `Schedule` gives the boundaries, the segments between them and the steps, each with the
schedule nested inside it. Each call of TensorFlow's own gradient function differentiates one
step and stops at the boundaries it reaches, returning the gradient that arrives at each of
them.

1. The ys are differentiated on the original forward ops, which are still in memory when the
   backward pass starts, down to the first boundaries.
2. Then each step's segments are copied and the copies differentiated, with the summed
   gradients arriving at its boundaries as `grad_ys`. The copies read the boundaries through
   the step's gate (NOTE [gates] in `gates.py`), so that the executor recomputes a segment
   only once backprop reaches it. A gate is private to its step, so TensorFlow's gradient
   call, which walks everything downstream of what it differentiates against, walks that step
   only.
3. A step with an inner schedule runs it on its copies: the inner steps copy the originals
   once more, reading the outer copies and gates through gates of their own (`_Values` says
   what stands for each tensor at each level).
4. Gradient parts arriving at each boundary and each x are summed as `tf.gradients` sums them.
   Ops that are not recomputed (variable reads) are differentiated as they ran, in the step
   of their outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import gradient_functions
from memory_saving_gradients._src.analysis.arguments import Gradient
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning.schedule import (
    Schedule,
    Segment,
    recomputed_repeatedly,
    spared,
)
from memory_saving_gradients._src.rewriting import editor, gates, ordering

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GradientOptions:
    """The `tf.gradients` arguments passed on to every step's gradient call."""

    name: str = "gradients"
    colocate_gradients_with_ops: bool = True
    gate_gradients: bool = False
    aggregation_method: object = None
    stop_gradients: tuple[tf.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Target:
    """A tensor a gradient call differentiates against, whose gradient that gives, and whether
    backprop stops there: at boundaries, which later steps take on from there; other xs, as
    in `tf.gradients`, let it pass."""

    tensor: tf.Tensor
    gradient_of: tf.Tensor
    stops: bool = True


@dataclasses.dataclass(frozen=True)
class _Part:
    """A gradient part a gradient call found, and the tensor it is for."""

    gradient: Gradient
    gradient_of: tf.Tensor


class _Backprop:
    """One checkpointed backward pass: TensorFlow's gradient calls and the parts they return."""

    def __init__(self, view: ForwardView, options: GradientOptions, values: _Values) -> None:
        self.view = view
        self.options = options
        self.values = values
        self._parts: dict[object, list[Gradient]] = {}
        #: Parts found since the last gate, which the next gate waits for.
        self._unwaited: list[_Part] = []
        #: The gates' outputs passing each tensor (by ref) on: they share its buffer.
        self.passed: dict[object, list[tf.Tensor]] = {}
        #: The view's ops differentiated by the library's own gradient functions, and theirs;
        #: their copies take the same (`differentiate`).
        self._replaced = gradient_functions.replaced(view.ops)

    def has_gradient(self, tensor: tf.Tensor) -> bool:
        return tensor.ref() in self._parts

    def gradient(self, tensor: tf.Tensor) -> Gradient:
        """Every part received for `tensor`, summed once when first read (colocated with the
        op of what stands for `tensor` where gradients are colocated with their ops, as
        TensorFlow sums)."""
        parts = self._parts[tensor.ref()]
        if len(parts) > 1:
            op = self.values.of(tensor).op
            with colocated(op, self.options.colocate_gradients_with_ops):
                parts[:] = [_tf.sum_gradients(parts)]
        return parts[0]

    def step_inputs(
        self, reached: Sequence[tf.Tensor], read: Sequence[tf.Tensor], scope: str
    ) -> tuple[list[tf.Tensor], list[Gradient]]:
        """What a step reads, passed through its gate (NOTE [gates] in `gates.py`): the
        boundaries its copies `read`, and the gradients arriving at the `reached` boundaries.
        The gate also waits for the gradient parts found since the last gate that `gates.waits`
        picks, and for the forward ops it names. A step that recomputes nothing (variable
        reads) has no gate: its gradients are final as soon as they exist."""
        incoming = [self.gradient(t) for t in reached]
        if not read:
            return [], incoming
        found = self._unwaited
        picked, not_run = gates.waits(self.view, reached, [part.gradient_of for part in found])
        waited = [part for part, wait in zip(found, picked, strict=True) if wait]
        self._unwaited = [part for part, wait in zip(found, picked, strict=True) if not wait]
        waited_parts = [part.gradient for part in waited]
        arriving = _flat(incoming)
        values = [self.values.of(t) for t in read]
        gated, passed = gates.gate(
            [*values, *arriving],
            arriving[0],
            _flat(waited_parts),
            scope,
            ran=[self.values.of(op.outputs[0]).op for op in not_run],
        )
        gated_incoming = tf.nest.pack_sequence_as(
            incoming, gated[len(read) :], expand_composites=True
        )
        passed_parts = tf.nest.pack_sequence_as(waited_parts, passed, expand_composites=True)
        for part, value in zip(waited, passed_parts, strict=True):
            parts = self._parts[part.gradient_of.ref()]
            parts[:] = [value if p is part.gradient else p for p in parts]
        return gated[: len(read)], gated_incoming

    def differentiate(
        self,
        ys: Sequence[tf.Tensor],
        grad_ys: Sequence[Gradient | None] | None,
        targets: Sequence[_Target],
        copies: dict[tf.Operation, tf.Operation],
        colocate: bool = True,
        name: str = "segment",
    ) -> None:
        """Backprop `grad_ys` from `ys` into the `targets`, keeping the parts found; the
        gradient ops are built under the name scope `name`.

        The user's stop_gradients stop their copies too. The library's gradient functions
        (`gradient_functions`) differentiate the view's ops and whatever copies of them the
        call reaches: this step's, and in a nested step the outer step's, which the inner
        schedule's first call differentiates. Gradient ops are colocated with
        their forward ops where the user asks for it and `colocate` (a step passing
        gradients into variable reads does not: see `checkpointed_gradients`).
        """
        user_stops = self.options.stop_gradients
        copied_stops = _copied(user_stops, copies)
        graph = ys[0].graph
        first_new = len(graph.get_operations())
        gradients = _tf.tensorflow_gradients(
            list(ys),
            [target.tensor for target in targets],
            None if grad_ys is None else list(grad_ys),
            name=name,
            colocate_gradients_with_ops=self.options.colocate_gradients_with_ops and colocate,
            gate_gradients=self.options.gate_gradients,
            aggregation_method=self.options.aggregation_method,
            stop_gradients=[*user_stops, *copied_stops],
            boundaries=[target.tensor for target in targets if target.stops],
            differentiated_by={
                differentiated: function
                for op, function in self._replaced.items()
                for differentiated in (op, self.values.copies.get(op), copies.get(op))
                if differentiated is not None
            },
        )
        made = graph.get_operations()[first_new:]
        self._read_recomputed(made, copies)
        ordering.products_kept_in_order(made, _flat(grad_ys or []))
        self.receive(targets, gradients)
        kept_parts = [
            gradient
            for target, gradient in zip(targets, gradients, strict=True)
            if gradient is not None and target.gradient_of.op not in self.view.recomputable
        ]
        ordering.weight_gradients_first([t.op for t in _flat(kept_parts)], made)

    def _read_recomputed(
        self, made: Sequence[tf.Operation], copies: Mapping[tf.Operation, tf.Operation]
    ) -> None:
        """Make the ops of one gradient call that read forward tensors of the pass they
        differentiate read what stands for them (NOTE [gradients closing over forward
        tensors]): `copies`' outputs, else the `values` of this level (the gates and copies
        of the steps around it, for the boundaries an inner schedule starts from too)."""
        for op in made:
            for index, tensor in enumerate(op.inputs):
                copy = copies.get(tensor.op)
                stand_in = (
                    copy.outputs[tensor.value_index]
                    if copy is not None
                    else self.values.of(tensor)
                )
                if stand_in is not tensor:
                    _tf.replace_input(op, index, stand_in)

    def receive(self, targets: Sequence[_Target], gradients: Sequence[Gradient | None]) -> None:
        """Keep the gradient parts found for `targets`."""
        for target, gradient in zip(targets, gradients, strict=True):
            if gradient is not None:
                self._parts.setdefault(target.gradient_of.ref(), []).append(gradient)
                self._unwaited.append(_Part(gradient, target.gradient_of))


@dataclasses.dataclass(frozen=True)
class _Values:
    """What stands for the tensors of a schedule's view in the backward pass being built: the
    forward pass's own tensors at the top level; inside a step with an inner schedule, the
    step's recomputed copies and its gates (nested recomputation copies the originals again,
    reading those)."""

    copies: dict[tf.Operation, tf.Operation] = dataclasses.field(default_factory=dict)
    gated: dict[object, tf.Tensor] = dataclasses.field(default_factory=dict)

    def of(self, tensor: tf.Tensor) -> tf.Tensor:
        if tensor.ref() in self.gated:
            return self.gated[tensor.ref()]
        if tensor.op in self.copies:
            return self.copies[tensor.op].outputs[tensor.value_index]
        return tensor


def checkpointed_gradients(
    schedule: Schedule, grad_ys: Sequence[Gradient | None] | None, options: GradientOptions
) -> list[Gradient | None]:
    """Gradients of the ys of `schedule.view` with respect to its xs (None where unconnected),
    running `schedule`: keeping its boundaries from the forward pass, and recomputing each
    step's segment, keeping only its inner schedule's boundaries where it has one (nested
    recomputation). Weight ops wait for their readers (NOTE [weight ops wait for their
    readers] in analysis/execution.py): in the forward pass where it runs in a function, and in
    every copy."""
    view = schedule.view
    execution = execution_of(view)
    waits = execution.weight_op_waits
    if not execution.weight_ops_run_early:
        for op, before_reader in waits.items():
            _tf.add_control_inputs(op, before_reader)
    return _run(schedule, view.ys, grad_ys, options, _Values(), waits)


def _run(
    schedule: Schedule,
    ys: Sequence[tf.Tensor],
    grad_ys: Sequence[Gradient | None] | None,
    options: GradientOptions,
    values: _Values,
    waits: Mapping[tf.Operation, Sequence[tf.Operation]],
    last_scope: str = "segment",
) -> list[Gradient | None]:
    """Backprop from `ys` (of `schedule.view`; `grad_ys` arriving at them) into its xs, with
    `values` standing for its tensors; gradient parts are kept by the tensor they are for.
    Copies of the ops of `waits` wait for those of the ops it gives. The last segment's
    gradients are built under `last_scope`, where its copies are (NOTE [names of recomputed
    ops])."""
    view = schedule.view
    _report_repeated_recomputation(view, schedule.checkpoints)
    user_stopped = {t.op for t in options.stop_gradients}
    backprop = _Backprop(view, options, values)

    with ys[0].graph.name_scope(options.name) as scope:
        last = schedule.last
        y_refs = {y.ref() for y in ys}
        targeted = {t.ref() for t in (*last.frontier, *last.xs)}
        xs_of_ys = [x for x in view.xs if x.ref() in y_refs and x.ref() not in targeted]
        ys_targets = [
            *(_Target(values.of(t), t) for t in last.frontier),
            *(_Target(values.of(x), x, stops=False) for x in last.xs),
            *(_Target(values.of(x), x, stops=schedule.is_boundary(x)) for x in xs_of_ys),
        ]
        backprop.differentiate(
            [values.of(y) for y in ys], grad_ys, ys_targets, {}, name=last_scope
        )
        for depth, step in enumerate(schedule.steps):
            reached = [
                t
                for op in step.boundary_ops
                if op not in user_stopped
                for t in op.outputs
                if schedule.is_boundary(t) and backprop.has_gradient(t)
            ]
            if not reached:
                continue
            reached_ops = tuple(dict.fromkeys(t.op for t in reached))
            segment = (
                step.segment
                if reached_ops == step.boundary_ops
                else Segment.union([schedule.segments[op] for op in reached_ops])
            )
            read = [t for t in segment.frontier if any(op in segment.ops for op in t.consumers())]
            gated_reads, incoming = backprop.step_inputs(
                reached, [*read, *segment.saved], f"{scope}step_{depth}/"
            )
            gated = {t.ref(): gate for t, gate in zip(read, gated_reads[: len(read)], strict=True)}
            for t, gate in zip([*read, *segment.saved], gated_reads, strict=True):
                backprop.passed.setdefault(t.ref(), []).append(gate)
            rerun = segment.rerun
            saved = {
                t.op: (
                    gate,
                    *spared(view, t, rerun, segment.ops, schedule.is_boundary),
                    bool(view.costs[t.op].saved_outputs),
                )
                for t, gate in zip(segment.saved, gated_reads[len(read) :], strict=True)
            }
            recompute_scope = f"{scope}recompute_{depth}/"  # NOTE [names of recomputed ops]
            remaking = schedule.drawing_again(segment)
            copies = editor.copy_ops(
                [*remaking, *sorted(segment.ops, key=view.position.__getitem__)],
                recompute_scope,
                gated,
                values.copies,
                stand_in=functools.partial(_saved_in, saved),
                waits=waits,
            )
            _draw_in_step(
                schedule,
                segment,
                copies,
                [t.op for t in gated_reads] or [t.op for t in _flat(incoming)],
            )
            targets = _targets(segment, gated, values)
            if step.inner is not None:
                inner_options = dataclasses.replace(
                    options,
                    stop_gradients=(
                        *options.stop_gradients,
                        *_copied(options.stop_gradients, copies),
                    ),
                )
                inner_values = _Values({**values.copies, **copies}, gated)
                gradients = _run(
                    step.inner,
                    reached,
                    incoming,
                    inner_options,
                    inner_values,
                    waits,
                    recompute_scope,
                )
                # The inner backward pass ends at its xs, the tensors this step gates.
                of_xs = {x.ref(): g for x, g in zip(step.inner.view.xs, gradients, strict=True)}
                backprop.receive(
                    targets,
                    [
                        of_xs.get(t.gradient_of.ref()) if _gates(t, gated) else None
                        for t in targets
                    ],
                )
            else:
                # A step without copies passes gradients into variable reads, which carry
                # no device under a distribution strategy: its gradients go on the caller's
                # device (an all-reduce needs one), and are placed as TensorFlow's when
                # passed on (`ordering.released_after_reads`).
                step_ys = [
                    copies[t.op].outputs[t.value_index] if t.op in copies else values.of(t)
                    for t in reached
                ]
                backprop.differentiate(
                    step_ys, incoming, targets, copies, colocate=bool(copies), name=recompute_scope
                )

        gradients = [backprop.gradient(x) if backprop.has_gradient(x) else None for x in view.xs]
        placement = {}
        for x in view.xs:
            arrived = [
                backprop.gradient(r)
                for r in execution_of(view).reads_of(x)
                if backprop.has_gradient(r)
            ]
            if arrived:
                placement[x.ref()] = _flat(arrived[:1])[0]
        return ordering.released_after_reads(
            view, gradients, backprop.passed, scope, placement, values.of
        )


# NOTE [gradients closing over forward tensors]: TensorFlow's gradient functions read the
# inputs and outputs of the op they differentiate, which for a recomputed segment are its
# copies. A `tf.custom_gradient` function instead closes over the forward tensors it was
# called with (`tf.nn.silu`, Keras's `silu` and `swish`): differentiating its copy builds
# ops reading the original tensors, which then stay alive from the forward pass until that
# gradient runs (a chain of silu layers, tests/test_memory.py).
# So the ops each gradient call makes are rerouted from forward tensors of the view to what
# stands for them at that point: the step's copies, the gates passing its boundaries on, and
# inside a nested step the outer step's copies and gates, also of the boundaries the inner
# schedule starts from (its xs, no ops of its view; tests/test_memory.py).


# NOTE [names of recomputed ops]: the gradients of a step's copies are built under the scope
# the copies are named in, as TensorFlow names gradients after their ops: a copy is `P/name`,
# a gradient of it `P/P/name_grad/...`, so the two compare by name as the original and its
# gradient under `tf.gradients` do (`name` against `gradients/...`). Grappler's rewrites depend
# on that order: common subgraph elimination sorts the inputs of commutative ops by name, and
# constant push-down then moves a constant onto the second. In the gradient of a scaled
# softmax, `(g - sum) * softmax * scale`, it pairs the scale with the incoming gradient under
# `tf.gradients`; were copies and their gradients named under unrelated scopes, it would pair
# the scale with the softmax, and `softmax * scale` would run as soon as the softmax is
# recomputed and hold an attention-sized buffer until the gradient arrives
# (tests/test_gradients.py checks the scaled softmax's gradient is built as tf.gradients has
# it).


def colocated(op: tf.Operation, colocate: bool):
    """A scope building ops colocated with `op`, where `colocate`; else none."""
    return (
        op.graph.colocate_with(op, ignore_existing=True) if colocate else contextlib.nullcontext()
    )


# NOTE [saved inside segments]: a tensor saved inside a segment is read from the forward pass
# (through the step's gate) by the copies of its readers, and its op is copied only for the
# gradient function, which reads that copy's inputs (recomputed) or its output, then the
# saved tensor, never both (only such ops are saved: `schedule.saveable`). The readers read
# it through a pass-through that is differentiated as that copy, so the step's one gradient
# call goes on through it into the recomputed ops behind, and the copy itself, whose output
# nothing reads, never runs. Where the op's gradient reads no input (a softmax, a tanh), the
# pass-through is differentiated as the ops behind it too, those no other gradient or copy
# reads (`schedule.spared`: the product of query and key and the transpose before a
# softmax), and reads what they read: their copies never run either.
def _saved_in(
    saved: dict[tf.Operation, tuple[tf.Tensor, list[tf.Operation], tuple[tf.Tensor, ...], bool]],
    op: tf.Operation,
    copy: tf.Operation,
) -> tf.Tensor | None:
    """What the copies reading `copy`'s output read instead where `op` makes a saved tensor:
    its gate, differentiated as `copy` and the copies of the ops it spares (NOTE [saved
    inside segments]); None where `op`'s output is not saved. `saved`: each saved tensor's
    op, its gate, the ops it spares and what they read (`schedule.spared`), and whether its
    gradient reads its output."""
    if op not in saved:
        return None
    gate, spares, frontier, reads_output = saved[op]
    copies, read = {op: copy}, {}
    for original in spares:  # each before those making its inputs
        for t, copied in zip(original.inputs, copies[original].inputs, strict=True):
            if t.op in spares:
                copies[t.op] = copied.op
            else:
                read[t.ref()] = copied
    with _tf.outside_caller_scopes(copy.graph), gates.placed_like(copy.outputs[0]):
        return _tf.differentiated_as(
            gate,
            [copies[original] for original in spares],
            [read[t.ref()] for t in frontier],
            reads_output,
        )


def _draw_in_step(
    schedule: Schedule,
    segment: Segment,
    copies: Mapping[tf.Operation, tf.Operation],
    step_started: Sequence[tf.Operation],
) -> None:
    """Make the first copies drawing each mask again wait for the copies one before its
    first reader (`Execution.drawn_after`), or for `step_started` (the step's gate) where
    there are none: they read only what the forward pass made, and the executor would
    otherwise draw every mask of the step as it starts, or in the forward pass, and hold it."""
    execution = execution_of(schedule.view)
    for tensor in schedule.remade_in(segment):
        drawing = set(execution.remakeable[tensor.ref()])
        after = [copies[op] for op in execution.drawn_after(tensor, segment.rerun)]
        for op in drawing:
            if not any(t.op in drawing for t in op.inputs):
                _tf.add_control_inputs(copies[op], after or step_started)


def _copied(tensors: Sequence[tf.Tensor], copies: dict) -> list[tf.Tensor]:
    """The copies of those of `tensors` whose ops were copied."""
    return [copies[t.op].outputs[t.value_index] for t in tensors if t.op in copies]


def _targets(segment: Segment, gated: dict[object, tf.Tensor], values: _Values) -> list[_Target]:
    """What a step's gradient call differentiates against: the gates its copies read, the
    boundaries its originals read, and the xs it reads (as `values` stand for them)."""
    targets = []
    for tensor in segment.frontier:
        if tensor.ref() in gated and _tf.is_differentiable(tensor):
            targets.append(_Target(gated[tensor.ref()], tensor))
        if any(reader in segment.originals for reader in tensor.consumers()):
            targets.append(_Target(values.of(tensor), tensor))
    targets.extend(_Target(values.of(x), x, stops=False) for x in segment.xs)
    return targets


def _gates(target: _Target, gated: dict[object, tf.Tensor]) -> bool:
    """Whether `target` is the gate passing on what it is the gradient of."""
    gate = gated.get(target.gradient_of.ref())
    return gate is not None and target.tensor is gate


def _report_repeated_recomputation(view: ForwardView, checkpoints: Sequence[tf.Tensor]) -> None:
    repeated = recomputed_repeatedly(view, checkpoints)
    if repeated:
        names = sorted(op.name for op in repeated)
        logger.warning(
            "%d ops are recomputed in several segments, e.g. %s: a path between checkpoints "
            "is not cut by any checkpoint. Checkpoints on that path, or checkpoints='memory', "
            "recompute each op once.",
            len(names),
            names[:3],
        )


def plain_gradients(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    grad_ys: Sequence[Gradient | None] | None,
    options: GradientOptions,
    unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
    view: ForwardView | None = None,
) -> list[Gradient | None]:
    """What `tf.gradients` gives, nothing recomputed, its products kept in the order it made
    them (NOTE [products reassociated ahead] in `ordering.py`); where a plan for `view` did
    not pay, its ops differentiated by the library's own functions where it has them
    (`gradient_functions`), as the plan's fallback peak predicts."""
    graph = ys[0].graph
    first_new = len(graph.get_operations())
    gradients = _tf.tensorflow_gradients(
        list(ys),
        list(xs),
        None if grad_ys is None else list(grad_ys),
        name=options.name,
        colocate_gradients_with_ops=options.colocate_gradients_with_ops,
        gate_gradients=options.gate_gradients,
        aggregation_method=options.aggregation_method,
        stop_gradients=list(options.stop_gradients),
        unconnected_gradients=unconnected_gradients,
        differentiated_by=gradient_functions.replaced(view.ops) if view is not None else None,
    )
    ordering.products_kept_in_order(graph.get_operations()[first_new:], _flat(grad_ys or []))
    return gradients


def _flat(gradients: Sequence[Gradient]) -> list[tf.Tensor]:
    """The dense tensors of `gradients` (an IndexedSlices has several)."""
    return tf.nest.flatten(list(gradients), expand_composites=True)
