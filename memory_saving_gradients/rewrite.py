"""Checkpointed backprop: differentiate the forward pass segment by segment, recomputing each.

The boundaries are the checkpoints plus the view's `must_keep` and `reused` tensors (what
non-recomputed ops read from recomputed ones, and the other way round). Each call of
TensorFlow's own gradient function differentiates one segment and stops at the boundaries it
reaches (its `stop_gradients`), returning the gradient that arrives at each of them. A
segment's copies read private identities of its boundaries: TensorFlow's gradient call walks
everything downstream of what it differentiates against, which for a boundary itself is the
rest of the graph, so without them building took (segments x graph size).

1. The ys are differentiated on the original forward ops, which are still in memory when the
   backward pass starts, down to the first boundaries.
2. Boundary ops are grouped into levels, a level only reading (through its segment) boundaries
   of earlier levels. From the last level back, each level's segment is copied, and the
   copies' gradient is taken with the summed incoming gradients as `grad_ys`. Every copy that
   reads no other copy waits (control input) for those incoming gradients, so the executor
   recomputes a segment only when backprop reaches it, and for the gradient parts of the
   segment differentiated before that go to kept tensors (xs, variable reads), so those are
   done and free what they read. Without the
   latter, parts nothing else waits for (a weight's, a bias's) may stay queued until the end
   of the backward pass, holding every tensor they read (seen with one inter-op thread, and
   with two tf.distribute replicas sharing two cores). Parts computed from the incoming
   gradients are not waited for: they hold nothing the segment does not hold anyway, and
   with oneDNN on, TensorFlow's graph optimizations merge such a part into this segment's op
   reading the same gradient (a convolution's bias gradient into its filter gradient), which
   turns the wait into a cycle. The waits also keep TensorFlow's common subexpression
   elimination from merging a copy with its original.
3. Gradient parts arriving at each boundary and each x are summed as `tf.gradients` sums them.
   Ops that are not recomputed (variable reads) are differentiated as they ran, at their own
   level: the reads of variables, which read nothing recomputed, all in the last call.

Stopping with `stop_gradients` rather than rerouting copies to `tf.stop_gradient` tensors adds
no ops and needs no copy for the last segment. It stops whole ops, so a boundary op keeps all
of its outputs that the forward pass reads as boundaries.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Sequence

import tensorflow as tf
from toposort import toposort

from memory_saving_gradients import _tf, editor, graph
from memory_saving_gradients.view import ForwardView

Gradient = tf.Tensor | tf.IndexedSlices

logger = logging.getLogger("memory_saving_gradients")


@dataclasses.dataclass(frozen=True)
class GradientOptions:
    """The `tf.gradients` arguments passed on to every segment's gradient call."""

    name: str = "gradients"
    colocate_gradients_with_ops: bool = True
    gate_gradients: bool = False
    aggregation_method: object = None
    stop_gradients: tuple[tf.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Segment:
    """The ops differentiated after some seeds, and the boundaries and xs it stops at.

    Its recomputable `ops` are copied; the others (`originals`) are differentiated as they ran.
    Outputs of non-recomputable ops that recomputable ops read are boundaries, so a segment
    behind a checkpoint holds recomputable ops only.
    """

    ops: frozenset[tf.Operation]
    originals: frozenset[tf.Operation]
    frontier: tuple[tf.Tensor, ...]
    xs: tuple[tf.Tensor, ...]

    @classmethod
    def behind(
        cls, seeds: Sequence[tf.Operation], view: ForwardView, is_boundary: Callable
    ) -> _Segment:
        reached = graph.backward_ops(seeds, within=view.position, stop_at=is_boundary)
        frontier = {t.ref(): t for op in reached for t in op.inputs if is_boundary(t)}
        xs = {x.ref() for x in view.xs}
        read_xs = {
            t.ref(): t
            for op in reached
            for t in op.inputs
            if t.ref() in xs and t.ref() not in frontier
        }
        recomputed = reached & view.recomputable
        return cls(
            recomputed, reached - recomputed, tuple(frontier.values()), tuple(read_xs.values())
        )

    def __or__(self, other: _Segment) -> _Segment:
        frontier = {t.ref(): t for t in (*self.frontier, *other.frontier)}
        xs = {t.ref(): t for t in (*self.xs, *other.xs)}
        return _Segment(
            self.ops | other.ops,
            self.originals | other.originals,
            tuple(frontier.values()),
            tuple(xs.values()),
        )

    def make_targets(self, scope: str) -> tuple[list[_Target], dict[object, tf.Tensor]]:
        """What the segment's gradient call differentiates against, and the inputs its copies
        read in place of boundaries: a private identity (made in `scope`) of each boundary a
        copy reads, so that TensorFlow's gradient call, which walks everything downstream of
        its targets, walks this segment only and not the whole graph after each boundary."""
        targets, private = [], {}
        for tensor in self.frontier:
            readers = set(tensor.consumers())
            if readers & self.ops and _tf.is_differentiable(tensor):
                private[tensor.ref()] = editor.private_input(tensor, scope)
                targets.append(_Target(private[tensor.ref()], tensor))
            if readers & self.originals or (readers & self.ops and tensor.ref() not in private):
                targets.append(_Target(tensor, tensor))
        targets.extend(_Target(x, x, stops=False) for x in self.xs)
        return targets, private


@dataclasses.dataclass(frozen=True)
class _Target:
    """A tensor a gradient call differentiates against, whose gradient that gives, and whether
    backprop stops there: at boundaries, which the segments before take on from there; other
    xs, as in `tf.gradients`, let it pass."""

    tensor: tf.Tensor
    gradient_of: tf.Tensor
    stops: bool = True


@dataclasses.dataclass(frozen=True)
class _Parts:
    """The gradient parts for kept tensors (xs, variable reads) one segment's backprop found,
    and the ops it made for them."""

    gradients: list[Gradient]
    made: frozenset[tf.Operation]

    def not_computed_from(self, incoming: Sequence[Gradient]) -> list[tf.Operation]:
        """The parts' ops that do not read, directly or through other ops made for these
        parts, any of the `incoming` gradients."""
        arriving = {t.ref() for t in tf.nest.flatten(list(incoming), expand_composites=True)}
        return [
            op
            for op in _ops_of(self.gradients)
            if not any(
                t.ref() in arriving
                for ancestor in graph.backward_ops([op], within=self.made)
                for t in ancestor.inputs
            )
        ]


class _Backprop:
    """One checkpointed backward pass: TensorFlow's gradient calls and the parts they return."""

    def __init__(self, view: ForwardView, options: GradientOptions) -> None:
        self.view = view
        self.options = options
        self._parts: dict[object, list[Gradient]] = {}

    def has_gradient(self, tensor: tf.Tensor) -> bool:
        return tensor.ref() in self._parts

    def gradient(self, tensor: tf.Tensor) -> Gradient:
        """Every part received for `tensor`, summed once when first read."""
        parts = self._parts[tensor.ref()]
        if len(parts) > 1:
            parts[:] = [_tf.sum_gradients(parts)]
        return parts[0]

    def differentiate(
        self,
        ys: Sequence[tf.Tensor],
        grad_ys: Sequence[Gradient | None] | None,
        targets: Sequence[_Target],
        copies: dict[tf.Operation, tf.Operation],
    ) -> _Parts:
        """Backprop `grad_ys` from `ys` into the `targets`, keeping the parts found.

        The user's stop_gradients stop their copies too. Returns the parts for tensors that
        are not recomputed (xs, variable reads), which no later segment waits for.
        """
        user_stops = self.options.stop_gradients
        copied_stops = [copies[t.op].outputs[t.value_index] for t in user_stops if t.op in copies]
        tensors = [target.tensor for target in targets]
        stops = [target.tensor for target in targets if target.stops]
        graph_ = ys[0].graph
        first_new = len(graph_.get_operations())
        gradients = _tensorflow_gradients(
            ys, tensors, grad_ys, [*stops, *user_stops, *copied_stops], self.options, "segment"
        )
        kept_parts = []
        for target, gradient in zip(targets, gradients, strict=True):
            if gradient is not None:
                self._parts.setdefault(target.gradient_of.ref(), []).append(gradient)
                if target.gradient_of.op not in self.view.recomputable:
                    kept_parts.append(gradient)
        return _Parts(kept_parts, frozenset(graph_.get_operations()[first_new:]))


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """The boundaries, the segment behind each boundary op, and the order of backprop: boundary
    ops in levels, each level's segments only reading boundaries of earlier levels."""

    boundaries: dict[object, tf.Tensor]
    segments: dict[tf.Operation, _Segment]
    levels: list[set[tf.Operation]]

    @classmethod
    def build(cls, view: ForwardView, checkpoints: Sequence[tf.Tensor]) -> _Schedule:
        boundaries = _boundaries(view, [*checkpoints, *view.must_keep, *view.reused])
        segments = {
            op: _Segment.behind([op], view, lambda t: t.ref() in boundaries)
            for op in {t.op for t in boundaries.values()}
        }
        dependencies = {op: {t.op for t in s.frontier} for op, s in segments.items()}
        return cls(boundaries, segments, list(toposort(dependencies)))

    def is_boundary(self, tensor: tf.Tensor) -> bool:
        return tensor.ref() in self.boundaries

    def ops_recomputed_repeatedly(self) -> set[tf.Operation]:
        """Ops in the segments of several levels: each of those levels recomputes them."""
        seen: set[tf.Operation] = set()
        repeated: set[tf.Operation] = set()
        for level in self.levels:
            ops = set().union(*(self.segments[op].ops for op in level))
            repeated |= ops & seen
            seen |= ops
        return repeated


def ops_recomputed_repeatedly(
    view: ForwardView, checkpoints: Sequence[tf.Tensor]
) -> set[tf.Operation]:
    """The ops that backprop with `checkpoints` would recompute more than once. Each path not
    cut by a checkpoint is recomputed by every segment behind it (the skip path of a residual
    network kept only at its convolutions)."""
    return _Schedule.build(view, checkpoints).ops_recomputed_repeatedly()


def checkpointed_gradients(
    view: ForwardView,
    checkpoints: Sequence[tf.Tensor],
    grad_ys: Sequence[tf.Tensor | None] | None,
    options: GradientOptions,
) -> list[Gradient | None]:
    """Gradients of `view.ys` with respect to `view.xs` (None where unconnected), keeping only
    `checkpoints` and what the view keeps anyway (`must_keep`, `reused`) from the forward
    pass."""
    schedule = _Schedule.build(view, checkpoints)
    _report_repeated_recomputation(schedule)
    is_boundary, segments = schedule.is_boundary, schedule.segments
    user_stopped = {t.op for t in options.stop_gradients}
    backprop = _Backprop(view, options)

    with view.ys[0].graph.name_scope(options.name) as scope:
        ys_segment = _Segment.behind([y.op for y in view.ys], view, is_boundary)
        frontier = {t.ref() for t in ys_segment.frontier}
        other_xs = [x for x in view.xs if x.ref() not in frontier]
        ys_targets = [
            *(_Target(t, t) for t in ys_segment.frontier),
            *(_Target(x, x, stops=is_boundary(x)) for x in other_xs),
        ]
        previous = backprop.differentiate(view.ys, grad_ys, ys_targets, {})
        for depth, level in enumerate(reversed(schedule.levels)):
            reached = [
                t
                for op in level
                if op not in user_stopped
                for t in op.outputs
                if is_boundary(t) and backprop.has_gradient(t)
            ]
            if not reached:
                continue
            segment = functools.reduce(operator.or_, (segments[t.op] for t in reached))
            targets, private = segment.make_targets(f"{scope}inputs_{depth}/")
            copies = editor.copy_ops(
                sorted(segment.ops, key=view.position.__getitem__),
                f"{scope}recompute_{depth}/",
                private,
            )
            incoming = [backprop.gradient(t) for t in reached]
            editor.add_control_inputs(
                _first_copies(copies),
                wait_for=[*_ops_of(incoming), *previous.not_computed_from(incoming)],
            )
            ys = [copies[t.op].outputs[t.value_index] if t.op in copies else t for t in reached]
            previous = backprop.differentiate(ys, incoming, targets, copies)

    return [backprop.gradient(x) if backprop.has_gradient(x) else None for x in view.xs]


def _report_repeated_recomputation(schedule: _Schedule) -> None:
    repeated = schedule.ops_recomputed_repeatedly()
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
) -> list[Gradient | None]:
    """What `tf.gradients` gives, nothing recomputed (None for unconnected xs)."""
    return _tensorflow_gradients(ys, xs, grad_ys, options.stop_gradients, options, options.name)


def _boundaries(view: ForwardView, tensors: Sequence[tf.Tensor]) -> dict[object, tf.Tensor]:
    """The given tensors, widened to every output of their ops that the forward pass reads."""
    ys = {y.ref() for y in view.ys}
    return {
        out.ref(): out
        for op in {t.op for t in tensors}
        for out in op.outputs
        if out.ref() in ys or view.consumers(out)
    }


def _first_copies(copies: dict[tf.Operation, tf.Operation]) -> list[tf.Operation]:
    """The copies that read no other copy: once they wait, the whole segment waits."""
    copied = set(copies.values())
    return [c for c in copied if not any(t.op in copied for t in c.inputs)]


def _ops_of(gradients: Sequence[Gradient]) -> list[tf.Operation]:
    tensors = tf.nest.flatten(list(gradients), expand_composites=True)
    return list({t.op: None for t in tensors})


def _tensorflow_gradients(ys, xs, grad_ys, stop_gradients, options: GradientOptions, name: str):
    return _tf.tensorflow_gradients(
        list(ys),
        list(xs),
        None if grad_ys is None else list(grad_ys),
        name=name,
        colocate_gradients_with_ops=options.colocate_gradients_with_ops,
        gate_gradients=options.gate_gradients,
        aggregation_method=options.aggregation_method,
        stop_gradients=list(stop_gradients),
    )
