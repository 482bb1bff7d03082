"""The order of a checkpointed backward pass: boundaries, the segment behind each, and steps.

The checkpoints, with the tensors a view keeps anyway (`must_keep`, `reused`), are the
boundaries. Behind each boundary op lies its segment: the ops that produce it again from the
boundaries before it. Backprop takes segments in steps, latest first, a step once every
segment reading its boundaries is done. Segments that share no op and read none of each
other's boundaries do not depend on each other; each gets a step of its own, one after the
other, so their recomputed tensors are never alive at once. With nested recomputation, a step
whose segment holds checkpoints of the next level carries the schedule of that segment,
recomputed from its frontier keeping only those: a tree.

Tensors `saved` inside segments (selective recomputation, as JAX's saveable policies) are kept
from the forward pass too, but cut nothing: the ops behind them stay in their segment, whose
recomputation reads them instead of running their ops again, and whose gradient call goes on
through them (a convolution's output kept, the batch norm and ReLU after it recomputed).

That tree is built once per plan, and the simulator (`simulation`), the plan's report and the
rewrite all walk it, so what is predicted is what runs. Building it walks each segment once.
Which ops a checkpoint list would recompute in several steps (`recomputed_repeatedly`, what
'speed' asks while it chooses) is found without building one: where a path is left uncut the
segments behind it overlap, and walking each of them is quadratic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import tensorflow as tf
from toposort import toposort

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import queries
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView


@dataclasses.dataclass(frozen=True)
class Segment:
    """Ops differentiated after some seeds, and the boundaries and xs where they stop.

    Its recomputable `ops` are copied; the others (`originals`) are differentiated as they
    ran. Outputs of non-recomputable ops that recomputable ops read are boundaries, so a
    segment behind a checkpoint holds recomputable ops only.
    """

    ops: frozenset[tf.Operation]
    originals: frozenset[tf.Operation]
    frontier: tuple[tf.Tensor, ...]
    xs: tuple[tf.Tensor, ...]
    saved: tuple[tf.Tensor, ...] = ()

    @classmethod
    def behind(
        cls,
        seeds: Iterable[tf.Operation],
        view: ForwardView,
        is_boundary: Callable[[tf.Tensor], bool],
        saved: dict[object, tf.Tensor] | None = None,
    ) -> Segment:
        """The segment behind `seeds`; of its ops, those making `saved` tensors (by ref)
        that other ops of it read are not run again (`Segment.saved`, `Segment.rerun`)."""
        reached = queries.backward_ops(seeds, within=view.position, stop_at=is_boundary)
        inputs = [t for op in sorted(reached, key=view.order) for t in op.inputs]
        frontier = _unique(t for t in inputs if is_boundary(t))
        read_xs = _unique(t for t in inputs if view.is_x(t) and not is_boundary(t))
        recomputed = reached & view.recomputable
        kept = _unique(t for t in inputs if saved and t.ref() in saved and t.op in recomputed)
        return cls(frozenset(recomputed), frozenset(reached - recomputed), frontier, read_xs, kept)

    @classmethod
    def union(cls, segments: Sequence[Segment]) -> Segment:
        return cls(
            frozenset().union(*(s.ops for s in segments)),
            frozenset().union(*(s.originals for s in segments)),
            _unique(t for s in segments for t in s.frontier),
            _unique(t for s in segments for t in s.xs),
            _unique(t for s in segments for t in s.saved),
        )

    @property
    def rerun(self) -> frozenset[tf.Operation]:
        """The ops recomputation runs again: `ops` but those making `saved` tensors, which
        are copied only for their gradient function (it reads their inputs' copies)."""
        return self.ops - {t.op for t in self.saved}


@dataclasses.dataclass(frozen=True)
class Step:
    """Segments backprop recomputes and differentiates together, one call of TensorFlow's
    gradient function.

    Attributes:
      boundary_ops: the boundary ops whose segments the step recomputes, in the view's order.
      segment: the union of their segments.
      inner: with nested recomputation, the schedule of the segment itself, recomputed from
        its frontier keeping only the next level's checkpoints inside it; else None.
    """

    boundary_ops: tuple[tf.Operation, ...]
    segment: Segment
    inner: Schedule | None = None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Boundaries, the segment behind each boundary op and behind the ys, and the steps,
    each with the schedule nested inside it: the one tree the simulator, the plan's report
    and the rewrite walk.

    Attributes:
      view: the forward graph scheduled (for a nested schedule, its segment's).
      checkpoints: the checkpoints it keeps (the further levels are in its steps' `inner`).
      saved: tensors kept inside segments, read by their recomputation (by `ref()`).
      boundaries: the boundary tensors by `ref()`.
      last: the segment behind the ys, differentiated on the forward pass's own ops.
      segments: the segment behind each boundary op.
      steps: the steps in backprop order; the segments of a step share ops, so they are
        differentiated together.
      remade: tensors made outside the view that the steps make again for the copies
        reading them, by `ref()` (NOTE [masks made again] in analysis/execution.py).
    """

    view: ForwardView
    checkpoints: tuple[tf.Tensor, ...]
    boundaries: dict[object, tf.Tensor]
    last: Segment
    segments: dict[tf.Operation, Segment]
    steps: tuple[Step, ...]
    saved: dict[object, tf.Tensor] = dataclasses.field(default_factory=dict)
    remade: dict[object, tf.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(
        cls,
        view: ForwardView,
        checkpoints: Sequence[tf.Tensor],
        nested: Sequence[Sequence[tf.Tensor]] = (),
        saved: Sequence[tf.Tensor] = (),
        remake_outside: bool = False,
    ) -> Schedule:
        """The schedule of backprop keeping `checkpoints`, and inside each step whose segment
        holds checkpoints of `nested[0]`, only those while it is recomputed (and so on for
        each further level of `nested`); `saved` tensors are kept inside segments (one level
        only: a nested recomputation would have to read them through its outer step). With
        `remake_outside`, masks made outside the view that only recomputed ops read are
        made again by the steps recomputing them (`remade`)."""
        if saved and nested:
            raise ValueError("Tensors saved inside segments need a plan of one level.")
        boundaries = _boundaries(view, [*checkpoints, *view.must_keep, *view.reused])
        kept = {t.ref(): t for t in saved if t.ref() not in boundaries and saveable(view, t)}

        def is_boundary(tensor: tf.Tensor) -> bool:
            return tensor.ref() in boundaries

        segments = {
            op: Segment.behind([op], view, is_boundary, kept)
            for op in _unique_ops(t.op for t in boundaries.values())
        }
        dependencies = {op: {t.op for t in s.frontier} for op, s in segments.items()}
        steps = [
            _step(view, group, segments, is_boundary, nested)
            for level in reversed(list(toposort(dependencies)))
            for group in _independent_groups(level, segments, view.order)
        ]
        last = Segment.behind([y.op for y in view.ys], view, is_boundary)
        remade = _remade(view, steps, last) if remake_outside else {}
        return cls(
            view, tuple(checkpoints), boundaries, last, segments, tuple(steps), kept, remade
        )

    def is_boundary(self, tensor: tf.Tensor) -> bool:
        return tensor.ref() in self.boundaries

    def remade_in(self, segment: Segment) -> list[tf.Tensor]:
        """The tensors of `remade` that `segment`'s copies read."""
        found = {t.ref(): t for op in segment.ops for t in op.inputs if t.ref() in self.remade}
        return list(found.values())

    def drawing_again(self, segment: Segment) -> list[tf.Operation]:
        """The ops making again the tensors `segment`'s copies read (`remade_in`), in the
        order they were made (NOTE [masks made again] in analysis/execution.py)."""
        remakeable = execution_of(self.view).remakeable
        ops = {op for t in self.remade_in(segment) for op in remakeable[t.ref()]}
        return sorted(ops, key=_tf.creation_index)


def _remade(view: ForwardView, steps: Sequence[Step], last: Segment) -> dict[object, tf.Tensor]:
    """The tensors made outside `view` that can be made again (`Execution.remakeable`)
    whose readers in the view the `steps` all recompute: the forward pass's own readers are
    then the last, and no gradient of theirs reads the tensor."""
    copied = frozenset().union(*(step.segment.ops for step in steps)) - last.ops
    remakeable = execution_of(view).remakeable
    return {
        t.ref(): t
        for op in view.ops
        for t in op.inputs
        if t.ref() in remakeable
        and all(reader in copied for reader in t.consumers() if reader in view.position)
    }


def saveable(view: ForwardView, tensor: tf.Tensor) -> bool:
    """Whether `tensor` can be saved inside a segment: the one output of a recomputable op
    whose gradient reads its inputs or its output, not both, so that the op's copy, made for
    that gradient, never runs (a gradient reading the output reads the saved tensor: NOTE
    [saved inside segments] in `rewriting/backprop.py`). Other tensors given as saved are
    recomputed as usual."""
    op = tensor.op
    if op not in view.recomputable or len(op.outputs) != 1:
        return False
    cost = view.costs[op]
    return not (cost.saved_outputs and cost.saved_inputs)


def spared(
    view: ForwardView,
    tensor: tf.Tensor,
    rerun: frozenset[tf.Operation],
    copied: frozenset[tf.Operation],
    is_boundary: Callable[[tf.Tensor], bool],
) -> tuple[list[tf.Operation], tuple[tf.Tensor, ...]]:
    """The ops that `tensor`, saved inside a segment, spares, its own first, and the tensors
    they read from the others: its op and the ops recomputed there (`rerun`, of the segment's
    `copied` ops) whose outputs only those ops read and no reader's gradient reads (a softmax
    kept, the product of query and key and the transpose before it; a query kept after its
    rotary embedding, the split, the products with sines and cosines and the projection
    before it): none of their copies runs. Each op comes before those making its inputs."""
    spares = {tensor.op}
    reached = [tensor.op]
    while reached:
        reader = reached.pop()
        for maker in dict.fromkeys(t.op for t in reader.inputs):
            if (
                maker not in spares
                and maker in rerun
                and _only_spares_read(view, maker, spares, copied, is_boundary)
            ):
                spares.add(maker)
                reached.append(maker)
    ops = sorted(spares, key=view.position.__getitem__, reverse=True)
    frontier = _unique(t for op in ops for t in op.inputs if t.op not in spares)
    return ops, frontier


def _only_spares_read(
    view: ForwardView,
    maker: tf.Operation,
    spares: set[tf.Operation],
    copied: frozenset[tf.Operation],
    is_boundary: Callable[[tf.Tensor], bool],
) -> bool:
    """Whether every output of `maker` is read, among `copied` ops, by `spares` alone, whose
    gradients do not read it, and no gradient of `maker` reads its outputs: then its copy
    need not run where none of theirs does."""
    if view.costs[maker].saved_outputs:
        return False
    for t in maker.outputs:
        if is_boundary(t):
            return False
        for reader in view.consumers(t):
            if reader not in copied:
                continue
            read_again = view.costs[reader].saved_inputs
            if reader not in spares or any(reader.inputs[i] is t for i in read_again):
                return False
    return True


def _step(
    view: ForwardView,
    boundary_ops: tuple[tf.Operation, ...],
    segments: dict[tf.Operation, Segment],
    is_boundary: Callable[[tf.Tensor], bool],
    nested: Sequence[Sequence[tf.Tensor]],
) -> Step:
    """The step recomputing the segments of `boundary_ops`, with its inner schedule where
    its segment holds checkpoints of `nested[0]`: from the segment's frontier to the
    boundaries among its outputs."""
    segment = Segment.union([segments[op] for op in boundary_ops])
    inner = [t for t in (nested[0] if nested else ()) if t.op in segment.ops]
    if not inner:
        return Step(boundary_ops, segment)
    ends = [t for op in sorted(segment.ops, key=view.order) for t in op.outputs if is_boundary(t)]
    sub = ForwardView.build(ends, list(segment.frontier), through_xs=False, enclosing=view)
    return Step(boundary_ops, segment, Schedule.build(sub, inner, nested[1:]))


def recomputed_repeatedly(
    view: ForwardView, checkpoints: Sequence[tf.Tensor]
) -> set[tf.Operation]:
    """The ops that backprop keeping `checkpoints` recomputes in several steps, found in one
    walk forward and one backward over the view.

    The step of a boundary op's segment comes from its level: the longest chain of
    boundaries behind it, by which `Schedule.build` orders steps. Segments of one level that
    share an op are one step, so an op is recomputed repeatedly exactly when the segments
    holding it (those of the boundary ops it reaches through tensors that are no boundaries)
    lie on several levels.
    """
    boundaries = _boundaries(view, [*checkpoints, *view.must_keep, *view.reused])
    boundary_ops = {t.op for t in boundaries.values()}
    level: dict[tf.Operation, int] = {}
    #: The highest level among the boundaries an op's segment walk would reach.
    behind: dict[tf.Operation, int] = {}
    for op in view.ops:  # in topological order but for TF1 loops' back edges, left out
        behind[op] = max(
            (
                level[t.op] if t.ref() in boundaries else behind[t.op]
                for t in op.inputs
                if t.op in behind
            ),
            default=-1,
        )
        if op in boundary_ops:
            level[op] = behind[op] + 1
    #: The lowest and highest level of the segments holding each op.
    span: dict[tf.Operation, tuple[float, float]] = {}
    for op in reversed(view.ops):
        if op in boundary_ops:
            span[op] = (level[op], level[op])
            continue
        readers = [span[r] for t in op.outputs for r in view.consumers(t) if r in span]
        span[op] = (
            min((low for low, _ in readers), default=math.inf),
            max((high for _, high in readers), default=-math.inf),
        )
    return {op for op, (low, high) in span.items() if low < high and op in view.recomputable}


def _independent_groups(
    level: set[tf.Operation],
    segments: dict[tf.Operation, Segment],
    order: Callable[[tf.Operation], int],
) -> list[tuple[tf.Operation, ...]]:
    """The boundary ops of one level in groups whose segments share no op, latest group first
    (the order backprop reaches them in). Segments of one level never read each other's
    boundaries, so only shared ops tie them together. Segments that recompute nothing
    (variable reads) form one group: they allocate nothing, and each TensorFlow gradient call
    walks everything downstream of what it differentiates against (for a variable, the rest
    of the graph), so one call for all of them keeps building linear."""
    group_of: dict[tf.Operation, int] = {}
    parent: list[int] = []

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    members = sorted(level, key=order)
    kept_only = [i for i, op in enumerate(members) if not segments[op].ops]
    for i, op in enumerate(members):
        parent.append(i)
        for recomputed in segments[op].ops:
            if recomputed in group_of:
                parent[find(group_of[recomputed])] = find(i)
            else:
                group_of[recomputed] = i
    for i in kept_only[1:]:
        parent[find(i)] = find(kept_only[0])
    groups: dict[int, list[tf.Operation]] = {}
    for i, op in enumerate(members):
        groups.setdefault(find(i), []).append(op)
    return sorted(
        (tuple(ops) for ops in groups.values()),
        key=lambda ops: -max(map(order, ops)),
    )


def _boundaries(view: ForwardView, tensors: Sequence[tf.Tensor]) -> dict[object, tf.Tensor]:
    """The given tensors, widened to every output of their ops that the forward pass reads."""
    ys = {y.ref() for y in view.ys}
    return {
        out.ref(): out
        for op in _unique_ops(t.op for t in tensors)
        for out in op.outputs
        if out.ref() in ys or view.consumers(out)
    }


def _unique(tensors: Iterable[tf.Tensor]) -> tuple[tf.Tensor, ...]:
    """`tensors` without repeats, in first-seen order."""
    return tuple({t.ref(): t for t in tensors}.values())


def _unique_ops(ops: Iterable[tf.Operation]) -> list[tf.Operation]:
    return list(dict.fromkeys(ops))
