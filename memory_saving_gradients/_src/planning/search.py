"""The search for the plan that fits a budget, and for the one with the least peak.

`cut_search` finds the cheapest cuts for a peak of its cost model, which counts what gradients
read; the peak simulated for a plan (`simulation`) is above it, and does not rise or fall
steadily with it. So plans for a budget of simulated bytes, or for the least simulated peak,
are searched for here: model peaks are tried, bisected, each plan is simulated, and the best
that fits is kept. Every knob of this search, and of the cut search's, is in `tunables`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import TypeGuard

import tensorflow as tf

from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning import cut_search, simulation, tunables
from memory_saving_gradients._src.planning.plans import MIB, Plan

logger = logging.getLogger(__name__)


def least_peak(view: ForwardView, label: str) -> Plan:
    """The plan recomputing least among those whose predicted peak is within
    `tunables.NESTING_GAIN` of the least found, called `label`."""
    order = cut_search.Order.of(view, view.costs)
    return _least_peak_of(view, order, label, simulation.plain_peak(view))


def _least_peak_of(view: ForwardView, order: cut_search.Order, label: str, plain: int) -> Plan:
    """`least_peak` on the cuts of `order`; `plain` is plain backprop's predicted peak."""
    candidates = _least_peak_candidates(view, order, label, plain)
    close = _near_least([plan for plan, _ in candidates], tunables.NESTING_GAIN)
    return _least_work([(plan, work) for plan, work in candidates if plan in close])


def _least_work(candidates: Sequence[tuple[Plan, float]]) -> Plan:
    """The plan of `candidates` (each with the forward compute it repeats) repeating least."""
    return min(candidates, key=lambda pair: pair[1])[0]


def as_it_ran_first(plan: Plan) -> Plan:
    """`plan` less the checkpoints behind which backprop would recompute first, for as long
    as that predicts no higher peak. The segment behind the ys is differentiated on the
    forward pass's own ops; the one backprop reaches next would be recomputed right after
    the forward pass made the same tensors, which are then held at the same time as they
    would have been, so recomputing it only repeats work (a loss's softmax cross-entropy
    behind a kept sum of it: `speed` keeps reductions), where what it would make again is
    a small part of the peak (`tunables.AS_IT_RAN_SHARE`). Plans of one level only."""
    while plan.pays and not plan.nested and plan.schedule.steps:
        view, step = plan.schedule.view, plan.schedule.steps[0]
        remade = sum(sum(view.costs[op].output_bytes) for op in step.segment.rerun)
        kept = [t for t in plan.checkpoints if t.op not in step.boundary_ops]
        if (
            not kept
            or len(kept) == len(plan.checkpoints)
            or remade > tunables.AS_IT_RAN_SHARE * plan.peak_bytes
        ):
            break
        shorter = Plan(view, [kept], plan.strategy, plan.plain_peak_bytes, plan.saved)
        if not shorter.peak_within(plan.peak_bytes):
            break
        plan = shorter
    return plan


def _near_least(plans: Sequence[Plan], gain: float) -> list[Plan]:
    """Those of `plans` whose predicted peak is within `gain` of the least of theirs, in
    their order. Each is simulated only until its peak passes that bound for the least found
    before it, last first (the plans for the smallest model peaks, where the least is most
    often found)."""
    least: float = math.inf
    near = []
    for plan in reversed(plans):
        if plan.peak_within(_above(least, gain)):
            near.append(plan)
            least = min(least, plan.peak_bytes)
    return [plan for plan in plans if plan in near and plan.peak_bytes <= _above(least, gain)]


def _above(least: float, gain: float) -> float:
    """`least` raised by `gain`; exactly `least` for no gain (a peak of many bytes times 1.0
    is a float that may round below the integer peak itself)."""
    return least * (1 + gain) if gain else least


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
    its size whole."""
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
    `headroom`; where none is, the plan of checkpoints='memory', logged. `plain` is plain
    backprop's predicted peak, `label` what the plan is called.

    Each of `saveable` is a set of tensors that plans may keep inside their segments
    (selective recomputation: one level of cuts, the ops of those tensors never recomputed);
    of the plans that fit, with each set and with none, the one recomputing least wins.
    Simulating plans is most of what planning costs, so the sets are searched in the order
    of the least their plans can recompute (the plan for the largest model peak the budget
    allows, built but not simulated), and the search stops at a set that cannot recompute
    less than the best plan found (the 1000-block residual MLP of `bench --suite build_time`,
    'balanced': eight sets, of which the first searched wins).
    """
    if budget >= plain:
        return Plan(view, [()], label, plain)
    searches = [
        _BudgetSearch(view, budget - headroom, plain, label, saved)
        for saved in ((), *(saved for saved in saveable if saved))
    ]
    best: Plan | None = None
    for each in sorted(searches, key=lambda each: each.least_recompute):
        cheaper_than = math.inf if best is None else best.recompute_flops_fraction
        if each.least_recompute >= cheaper_than:
            break
        plan = each.one_level(cheaper_than)
        if plan is not None and (
            best is None
            or (plan.recompute_flops_fraction, plan.peak_bytes)
            < (best.recompute_flops_fraction, best.peak_bytes)
        ):
            best = plan
    return best if best is not None else searches[0].nested(budget)


class _BudgetSearch:
    """The search for a budget's plan among those keeping one set of `saved` tensors inside
    their segments (none: every plan, nested ones too).

    Where one level of cuts reaches the budget, the largest model peak whose plan fits is
    bisected between one level's least and the budget scaled to the model; below, nested
    plans are tried for model peaks tightened until one fits, and then the plans whose
    peaks may be the least, of which one may still fit.
    """

    def __init__(
        self,
        view: ForwardView,
        usable: float,
        plain: int,
        label: str,
        saved: Sequence[tf.Tensor] = (),
    ) -> None:
        self.view, self.usable, self.plain, self.label, self.saved = (
            view, usable, plain, label, saved
        )  # fmt: skip
        self.order = cut_search.Order.of(view, view.costs, saved)
        self.target = usable * self.order.segment_peak() / plain if plain else usable
        if len(self.order.ops):
            flat, self.flat_peak = cut_search.smallest_peak(self.order)
            self.least = self._plan(flat)
            self.widest = self._plan_for(max(self.target, self.flat_peak), nesting=0)

    @functools.cached_property
    def least_recompute(self) -> float:
        """The least any one-level plan of this search may recompute: the widest one's."""
        if not len(self.order.ops):
            return math.inf
        widest = self.widest or self.least
        return widest.recompute_flops_fraction

    def one_level(self, cheaper_than: float = math.inf) -> Plan | None:
        """The one-level plan recomputing least that fits and recomputes less than
        `cheaper_than`, bisected on the model peak; None where there is none."""
        if not len(self.order.ops) or not self._fits(self.least):
            return None
        if self._fits(self.widest):
            return self.widest
        fitting, low, high = self.least, self.flat_peak, max(self.target, self.flat_peak)
        for _ in range(tunables.BUDGET_BISECTIONS):
            middle = (low + high) / 2
            plan = self._plan_for(middle, nesting=0)
            # A plan recomputing too much loses, and so do those for smaller model peaks.
            if plan is not None and plan.recompute_flops_fraction >= cheaper_than:
                low = middle
            elif self._fits(plan):
                fitting, low = plan, middle
            else:
                high = middle
        return fitting if fitting.recompute_flops_fraction < cheaper_than else None

    def nested(self, budget: float) -> Plan:
        """Nested plans for model peaks tightened until one fits `usable`; else, of the
        plans whose peaks may be the least, the one recomputing least within `budget`; else
        the plan of checkpoints='memory' (the least recompute near the least predicted
        peak), logged."""
        if not len(self.order.ops):
            return Plan(self.view, [()], self.label, self.plain)
        target = self.target
        for _ in range(tunables.BUDGET_BISECTIONS):
            plan = self._plan_for(target, nesting=tunables.MAX_NESTING)
            if plan is None:
                break
            if self._fits(plan):
                return plan
            target *= 0.98 * self.usable / plan.peak_bytes
        candidates = _least_peak_candidates(self.view, self.order, self.label, self.plain)
        within = [(plan, work) for plan, work in candidates if plan.peak_within(budget)]
        if within:
            return _least_work(within)
        least = _least_peak_of(self.view, self.order, self.label, self.plain)
        _log_below_reach(self.label, budget, least)
        return least

    def _plan(self, cuts: cut_search.Cuts) -> Plan:
        checkpoints = cut_search.checkpoints_of(self.order, cuts)
        return Plan(self.view, checkpoints, self.label, self.plain, self.saved)

    def _plan_for(self, model_peak: float, nesting: int) -> Plan | None:
        cuts = cut_search.within(self.order, model_peak, nesting=nesting)
        return None if cuts is None else self._plan(cuts)

    def _fits(self, plan: Plan | None) -> TypeGuard[Plan]:
        return plan is not None and plan.peak_within(self.usable)


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
    return min(_near_least(plans, 0.0), key=lambda plan: plan.peak_bytes)


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
    one level's cuts for its least model peak and a few larger ones, the distinct nested
    plans for ever smaller model peaks (bisected), and for model peaks spread between the
    least and one level's (`tunables.LEAST_PEAK_SHARES`). The simulated peak does not fall
    steadily with the model's, so each is simulated."""
    found, high = _one_level_candidates(order)
    low = order.least_peak()
    for share in tunables.LEAST_PEAK_SHARES:
        if (cuts := cut_search.within(order, low + share * (high - low))) is not None:
            found[cuts] = None
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


#: Budgets already said to be below reach: a model traced again, or built at several sizes
#: (the demo's depths), is told at info level after the first warning.
_SAID_BELOW_REACH: set[str] = set()


def _log_below_reach(label: str, budget: float, least: Plan) -> None:
    """Say that no plan fits the budget `label` asks for, and that 'memory''s plan, `least`,
    is used: a warning the first time for that budget, info after."""
    log = logger.info if label in _SAID_BELOW_REACH else logger.warning
    _SAID_BELOW_REACH.add(label)
    log(
        "%s (%.1f MiB) is below the least predicted peak: using the plan of "
        "checkpoints='memory', %.1f MiB (%.2f of plain backprop's %.1f MiB), recomputing "
        "%.2f of the forward compute.",
        label, budget / MIB, least.peak_bytes / MIB,
        least.peak_bytes / least.plain_peak_bytes, least.plain_peak_bytes / MIB,
        least.recompute_flops_fraction,
    )  # fmt: skip
