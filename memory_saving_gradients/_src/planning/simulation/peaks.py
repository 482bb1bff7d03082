"""The peaks plans predict: of plain backprop, and of checkpointed backprop walking its
schedule's tree of steps, each simulated on one `Simulator` (the model: the package's
docstring).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Collection, Iterable, Sequence

from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning.schedule import Schedule, Segment, Step
from memory_saving_gradients._src.planning.simulation.ledger import ORIGINAL, OverLimit
from memory_saving_gradients._src.planning.simulation.simulator import Simulator


def _add(uses: dict[int, int], more: Iterable[int]) -> dict[int, int]:
    """`uses` with one more use of each of `more`."""
    for t in more:
        uses[t] = uses.get(t, 0) + 1
    return uses


#: `plain_peak` of each view, by `as_rewritten`: a search plans one view many times, and
#: what the simulation reads of a view (its costs, its numbering) is fixed once read.
_PLAIN_PEAKS: weakref.WeakKeyDictionary[ForwardView, dict[bool, int]] = weakref.WeakKeyDictionary()


def plain_peak(view: ForwardView, as_rewritten: bool = False) -> int:
    """Simulated peak bytes of backprop that keeps every activation its gradients read, as
    `tf.gradients` runs it, or, `as_rewritten`, as the rewrite runs it where a plan does not
    pay: TensorFlow's optimizers do not move its products into the forward pass
    (`Execution.products_ahead`), and its gradient functions are the library's where it has
    its own (`gradient_functions`)."""
    known = _PLAIN_PEAKS.setdefault(view, {})
    if as_rewritten not in known:
        if as_rewritten and not _rewritten_differently(view):
            known[as_rewritten] = plain_peak(view)
        else:
            known[as_rewritten] = _plain(view, as_rewritten)
    return known[as_rewritten]


def _rewritten_differently(view: ForwardView) -> bool:
    """Whether the rewrite's plain backprop runs otherwise than `tf.gradients` on `view`: its
    products kept in order where TensorFlow's optimizers move them ahead, or gradient
    functions of the library's own."""
    return bool(execution_of(view).products_ahead) or any(
        view.costs[op].tensorflow_gradient is not None for op in view.ops
    )


def _plain(view: ForwardView, as_rewritten: bool) -> int:
    run = Simulator(
        view,
        updates_copy=True,
        products_ahead=not as_rewritten,
        registered_gradients=not as_rewritten,
    )
    ops = list(range(len(view.ops)))
    run.made_outside()
    run.forward(run.forward_order(), (ORIGINAL,), _add(run.uses(ops), run.tensor_ids(view.ys)))
    run.seed()
    run.differentiate(ops, (ORIGINAL,))
    return run.ledger.peak


def checkpointed_peak(schedule: Schedule, limit: float = math.inf) -> int | None:
    """Simulated peak bytes of backprop with `schedule`: keeping its boundaries, and inside
    each step with an inner schedule, only that one's while the step recomputes. None where
    the peak passes `limit` (the simulation stops there)."""
    view = schedule.view
    run = Simulator(view, limit=limit)
    try:
        return _checkpointed(run, schedule)
    except OverLimit:
        return None


def _checkpointed(run: Simulator, schedule: Schedule) -> int:
    view = schedule.view
    last = _ops_of(run, schedule.last)
    uses = _add(run.uses(last), run.tensor_ids(view.ys))
    for step in schedule.steps:
        _add(uses, run.uses(run.positions(step.segment.originals)))
        _add(uses, run.tensor_ids(_read_from_before(step.segment)))
    run.made_outside(schedule.remade)
    run.forward(run.forward_order(), (ORIGINAL,), uses)
    run.seed()
    run.differentiate(last, (ORIGINAL,))
    _steps(run, schedule.steps, (ORIGINAL,), schedule.remade)
    return run.ledger.peak


def _steps(
    run: Simulator,
    steps: Sequence[Step],
    outer: tuple[int, ...],
    remade: Collection[object] = (),
) -> None:
    """Simulate `steps`, whose boundaries live at the levels of `outer`; each makes again
    the tensors of `remade` (made outside the view, by `ref()`) that its copies read."""
    frontiers = [run.tensor_ids(_read_from_before(step.segment)) for step in steps]
    last_read = {t: j for j, frontier in enumerate(frontiers) for t in frontier}
    for j, (step, frontier) in enumerate(zip(steps, frontiers, strict=True)):
        chain = (run.ledger.new_level(), *outer)
        inherited = frozenset(t for t in frontier if last_read[t] == j)
        segment = step.segment
        rerun = run.positions(segment.rerun)
        remade_here = run.remake(rerun, remade) if remade else []
        if step.inner is not None:
            _nested_step(run, step, step.inner, chain, frontier, inherited)
        else:
            copied = run.positions(segment.ops)
            released = inherited | run.gate_copies(frontier, rerun, chain, inherited)
            run.forward(rerun, chain, run.uses(copied), released)
            run.drawn_before.clear()  # draws whose readers' copies did not run
            run.differentiate(_ops_of(run, segment), chain, copied, released)
        for t in frontier:
            if t not in inherited:
                run.ledger.release(run.ledger.buffer(t, outer))
        for buffer in remade_here:
            run.ledger.release(buffer)


def _nested_step(
    run: Simulator,
    step: Step,
    inner: Schedule,
    chain: tuple[int, ...],
    frontier: list[int],
    inherited: frozenset[int],
) -> None:
    """A step recomputing its segment (from its `frontier`) while keeping only the
    boundaries of its `inner` schedule: the inner schedule's last segment is differentiated
    as recomputed, its other segments are recomputed once more."""
    segment = step.segment
    steps = [s for s in inner.steps if s.segment.ops]
    last = run.positions((inner.last.ops | inner.last.originals) & segment.ops)
    recomputed = run.positions(segment.ops)
    released = inherited | run.gate_copies(frontier, recomputed, chain, inherited)
    uses = run.uses(last)
    for s in steps:
        _add(uses, run.tensor_ids(t for t in s.segment.frontier if t.op in segment.ops))
        # The inner steps release their boundaries from outside the segment too (or their
        # copies under XLA), which live on meanwhile: each needs a hold of its own.
        for t in run.tensor_ids(t for t in s.segment.frontier if t.op not in segment.ops):
            run.ledger.hold(run.ledger.buffer(t, chain))
    run.forward(recomputed, chain, uses, released)
    run.drawn_before.clear()  # draws whose readers' copies did not run
    run.differentiate(last, chain, recomputed, released)
    _steps(run, steps, chain)


def _read_from_before(segment: Segment) -> tuple:
    """What a step's recomputation reads from before it: the segment's frontier and the
    tensors saved inside it."""
    return (*segment.frontier, *segment.saved)


def _ops_of(run: Simulator, segment: Segment) -> list[int]:
    """The positions of the ops `segment` differentiates, in topological order."""
    return run.positions(segment.ops | segment.originals)
