"""The search for the plan that fits a budget, and for the one with the least peak.

`cut_search` finds the cheapest cuts for a peak of its cost model, which counts what gradients
read; the peak simulated for a plan (`simulation`) is above it, and does not rise or fall
steadily with it. So plans for a budget of simulated bytes, or for the least simulated peak,
are searched for here: model peaks are tried, bisected, each plan is simulated, and the best
that fits is kept. Every knob of this search, and of the cut search's, is in `tunables`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeGuard

import tensorflow as tf

from memory_saving_gradients.analysis.view import ForwardView
from memory_saving_gradients.planning import cut_search, simulation, tunables
from memory_saving_gradients.planning.plans import MIB, Plan

logger = logging.getLogger(__name__)


def least_peak(view: ForwardView, label: str) -> Plan:
    """The plan recomputing least among those whose predicted peak is within
    `tunables.NESTING_GAIN` of the least found, called `label`."""
    order = cut_search.Order.of(view, view.costs)
    candidates = _least_peak_candidates(view, order, label, simulation.plain_peak(view))
    least = min(plan.peak_bytes for plan, _ in candidates)
    close = [
        (work, plan)
        for plan, work in candidates
        if plan.peak_bytes <= least * (1 + tunables.NESTING_GAIN)
    ]
    return min(close, key=lambda pair: pair[0])[1]


def one_level_least_peak(view: ForwardView, plain: int) -> int:
    """The predicted peak of the one-level cuts with the least model peak; `plain` is plain
    backprop's predicted peak."""
    order = cut_search.Order.of(view, view.costs)
    flat, _ = cut_search.smallest_peak(order)
    return Plan(view, cut_search.checkpoints_of(order, flat), "one level", plain).peak_bytes


def budget_headroom(view: ForwardView) -> int:
    """What a budget keeps free beside the predicted peak: the largest tensor a recomputed op
    makes. TensorFlow's executor may order ready ops so that one more tensor is alive than
    the cost model's order has, and its allocator hands a request a free block of up to twice
    its size whole (128-layer chain, MemoryBudget(0.1): predicted 26 MiB, measured 28)."""
    return max(
        (view.bytes(t) for op in view.ops if op in view.recomputable for t in op.outputs),
        default=0,
    )


def within_budget(
    view: ForwardView,
    budget: float,
    plain: int,
    label: str,
    headroom: int = 0,
    saveable: Sequence[Sequence[tf.Tensor]] = (),
) -> Plan:
    """The plan recomputing least whose predicted peak is within `budget` bytes, less
    `headroom`; where none is, the one with the smallest predicted peak (logged unless it is
    within `budget`). `plain` is plain backprop's predicted peak, `label` what the plan is
    called.

    Each of `saveable` is a set of tensors that plans may keep inside their segments
    (selective recomputation: one level of cuts, the ops of those tensors never recomputed);
    of the plans that fit, with each set and with none, the one recomputing least wins.
    """
    first = _within_budget(view, budget, plain, label, headroom)
    assert first is not None  # plans saving nothing always give one
    plans = [first]
    for saved in saveable:
        if saved and (plan := _within_budget(view, budget, plain, label, headroom, saved)):
            plans.append(plan)
    fitting = [plan for plan in plans if plan.peak_bytes <= budget - headroom]
    if not fitting:
        return first
    return min(fitting, key=lambda plan: (plan.recompute_flops_fraction, plan.peak_bytes))


def _within_budget(
    view: ForwardView,
    budget: float,
    plain: int,
    label: str,
    headroom: int,
    saved: Sequence[tf.Tensor] = (),
) -> Plan | None:
    """`within_budget` for one set of `saved` tensors (None where one level with them does
    not fit; plans saving nothing nest where one level does not fit, and end in the plan with
    the smallest predicted peak, logged where it does not fit).

    Where one level of cuts reaches the budget, the largest model peak whose plan fits is
    bisected between one level's least and the budget scaled to the model; below, nested
    plans are tried for model peaks tightened until one fits, and then the plan with the
    smallest predicted peak, which may still fit.
    """
    order = cut_search.Order.of(view, view.costs, saved)
    if budget >= plain or not len(order.ops):
        return Plan(view, [()], label, plain)

    def plan_for(model_peak: float, nesting: int) -> Plan | None:
        cuts = cut_search.within(order, model_peak, nesting=nesting)
        return (
            None
            if cuts is None
            else Plan(view, cut_search.checkpoints_of(order, cuts), label, plain, saved)
        )

    usable = budget - headroom

    def fits(plan: Plan | None) -> TypeGuard[Plan]:
        return plan is not None and plan.peak_bytes <= usable

    flat, flat_peak = cut_search.smallest_peak(order)
    least = Plan(view, cut_search.checkpoints_of(order, flat), label, plain, saved)
    target = usable * order.segment_peak() / plain if plain else usable
    if fits(least):
        if fits(widest := plan_for(max(target, flat_peak), nesting=0)):
            return widest
        fitting, low, high = least, flat_peak, max(target, flat_peak)
        for _ in range(tunables.BUDGET_BISECTIONS):
            middle = (low + high) / 2
            if fits(plan := plan_for(middle, nesting=0)):
                fitting, low = plan, middle
            else:
                high = middle
        return fitting
    if saved:
        return None
    for _ in range(tunables.BUDGET_BISECTIONS):
        plan = plan_for(target, nesting=tunables.MAX_NESTING)
        if plan is None:
            break
        if fits(plan):
            return plan
        target *= 0.98 * usable / plan.peak_bytes
    smallest = _smallest(view, order, label, plain)
    if smallest.peak_bytes <= budget:
        return smallest
    logger.warning(
        "No checkpoints fit %s (%.1f MiB): the smallest predicted peak is %.1f MiB (%.2f of "
        "plain backprop's %.1f MiB); using the checkpoints that give it.",
        label, budget / MIB, smallest.peak_bytes / MIB, smallest.peak_bytes / plain, plain / MIB,
    )  # fmt: skip
    return smallest


def least_peak_saving(view: ForwardView, saved: Sequence[tf.Tensor], label: str) -> Plan:
    """Of one level's cuts keeping `saved` inside segments, for its least model peak and a
    few larger ones (`tunables.ONE_LEVEL_SCALES`), the plan with the least predicted peak:
    only the ops of tensors not saved are recomputed."""
    order = cut_search.Order.of(view, view.costs, saved)
    plain = simulation.plain_peak(view)
    found, _ = _one_level_candidates(order)
    plans = [
        Plan(view, cut_search.checkpoints_of(order, cuts), label, plain, saved) for cuts in found
    ]
    return min(plans, key=lambda plan: plan.peak_bytes)


def _one_level_candidates(order: cut_search.Order) -> tuple[dict, float]:
    """One level's cuts for its least model peak and a few larger ones
    (`tunables.ONE_LEVEL_SCALES`), as the keys of a dict, and that least model peak."""
    flat, least = cut_search.smallest_peak(order)
    found = {flat: None}
    for scale in tunables.ONE_LEVEL_SCALES:
        if (cuts := cut_search.within(order, scale * least, nesting=0)) is not None:
            found[cuts] = None
    return found, least


def _least_peak_candidates(
    view: ForwardView, order: cut_search.Order, label: str, plain: int
) -> list[tuple[Plan, float]]:
    """Plans whose predicted peaks may be the least, each with the forward compute it repeats:
    one level's cuts for its least model peak and a few larger ones, and the distinct nested
    plans for ever smaller model peaks (bisected). The simulated peak does not fall steadily
    with the model's, so each is simulated."""
    found, high = _one_level_candidates(order)
    low = order.least_peak()
    for _ in range(tunables.LEAST_PEAK_BISECTIONS):
        middle = (low + high) / 2
        cuts = cut_search.within(order, middle)
        if cuts is None:
            low = middle
        else:
            high = middle
            found[cuts] = None
    return [
        (Plan(view, cut_search.checkpoints_of(order, cuts), label, plain),
         cut_search.recompute_work(order, cuts))
        for cuts in found
    ]  # fmt: skip


def _smallest(view: ForwardView, order: cut_search.Order, label: str, plain: int) -> Plan:
    """The plan with the smallest predicted peak of `_least_peak_candidates`."""
    return min(
        (plan for plan, _ in _least_peak_candidates(view, order, label, plain)),
        key=lambda plan: plan.peak_bytes,
    )
