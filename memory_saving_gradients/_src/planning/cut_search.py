"""Choose checkpoints for a peak: cuts of the forward pass, nested where one level is not enough.

Cut a topological order of the recomputable ops at any point, and the tensors alive across
that point (made before it, read after it) separate the two halves: keeping them lets the half
after the cut be recomputed without the half before. The single-tensor cuts are the
"bottlenecks" of the original library; a cut may hold several tensors (skip connections, dense
blocks), so a plan exists for every graph.

Backprop runs over the segments between cuts from last to first. While it differentiates a
segment it holds what that segment's gradients read plus the cuts before it: the cuts after it
are spent. So the peak is the largest, over segments, of "cuts before + segment", and the best
plans make segments shorter towards the end. On a uniform chain of n layers the optimum keeps
about sqrt(2n) tensors in segments that shrink by one layer each, for a peak of about sqrt(2n)
activations, where equal segments (Chen et al. 2016) need 2 sqrt(n). For a peak, a dynamic
programme over the order finds whether cuts meet it, and the cheapest such cuts; a bisection
finds the smallest peak one level of cuts can meet.

Below that, segments are cut again (nested recomputation): a segment recomputed with inner
cuts holds only those and one inner segment at a time, and its inner segments are recomputed
once more when backprop reaches them. Top-level cuts are then chosen for a larger peak, each
segment is planned within what the cuts before it leave, recursively, and of the candidates
that fit, the one recomputing least wins. The search drops candidates as soon as they
recompute more than the best so far, stops raising the top-level peak once that does no
better, and reuses what it found for a segment, which it meets again under many top-level
cuts. Each level costs about one more forward pass and takes the square root of what it
holds, so a few levels reach O(log n) activations on chains.

The plans for budgets and for the least peak are searched over these cuts in `search`; the
knobs of both are in `tunables`.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from memory_saving_gradients._src.analysis import costs, kernels
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning import tunables


@dataclasses.dataclass(frozen=True)
class Cuts:
    """Cuts of an order of ops and, for each segment they make, the cuts nested in it.

    Cut `p` lies between the ops at positions `p` and `p + 1`. A segment runs from just after
    one cut to the next; `inner[j]` cuts segment j, or is None.
    """

    positions: tuple[int, ...]
    inner: tuple[Cuts | None, ...]

    @property
    def levels(self) -> int:
        """Levels of cuts, this one included."""
        return 1 + max((c.levels for c in self.inner if c is not None), default=0)


@dataclasses.dataclass(frozen=True, eq=False)
class Order:
    """The recomputable ops of a view in topological order, with what the cost model needs.

    Attributes:
      ops: the ops.
      held: bytes of each op's outputs that backprop holds (some gradient reads them).
      compute: what recomputing each op costs (`costs.OpCost.compute`); nothing for the ops
        of tensors saved inside segments, which are not recomputed.
      saved_before: bytes of the tensors saved inside segments made before each op: backprop
        holds them, whatever the cuts, until it reaches the segment they are in.
      gradients: bytes of the xs' gradients made by the time backprop reaches each op (those
        of the xs read at or after it), where the view holds them to the end of the step;
        zeros where each is applied once complete.
      tensors: the tensors read after the op making them, in the order of their producers;
        `made` and `last` give the positions of the producer and of the last reader (the
        view's ys live to the end), `weight` the bytes a cut pays to keep each (less a tie
        break for tensors backprop would not hold anyway).
      searched: what `within` found so far for each segment and nesting, which it reuses (a
        nested search meets the same segments under many top-level cuts).
    """

    ops: tuple[tf.Operation, ...]
    held: np.ndarray
    compute: np.ndarray
    gradients: np.ndarray
    saved_before: np.ndarray
    tensors: tuple[tf.Tensor, ...]
    made: np.ndarray
    last: np.ndarray
    weight: np.ndarray
    searched: dict[tuple[int, int, int], list[_Searched]] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )

    @classmethod
    def of(
        cls,
        view: ForwardView,
        cost: dict[tf.Operation, costs.OpCost],
        saved: Sequence[tf.Tensor] = (),
    ) -> Order:
        """The order of `view`'s recomputable ops, keeping `saved` inside segments."""
        saved_refs = {t.ref() for t in saved}
        ops = tuple(op for op in view.ops if op in view.recomputable)
        position = {op: i for i, op in enumerate(ops)}
        read = _read_by_gradients(view, cost)
        always_kept = {t.ref() for t in view.must_keep}
        ys = {y.ref() for y in view.ys}
        held = np.zeros(len(ops))
        saved_bytes = np.zeros(len(ops))
        tensors, made, last, weight = [], [], [], []
        for i, op in enumerate(ops):
            for tensor, size in zip(op.outputs, cost[op].output_bytes, strict=True):
                if tensor.ref() in always_kept:
                    continue
                if tensor.ref() in saved_refs:
                    saved_bytes[i] += size
                kept = tensor.ref() in read
                held[i] += size * kept
                readers = [position[r] for r in view.consumers(tensor) if r in position]
                end = len(ops) - 1 if tensor.ref() in ys else max(readers, default=i)
                if end > i:
                    tensors.append(tensor)
                    made.append(i)
                    last.append(end)
                    bytes_ = 0 if tensor.ref() in saved_refs else kernels.tensor_bytes(tensor)
                    tie_break = (not kept) - tunables.FUSION_SPLIT * _read_by_bias_add(tensor)
                    weight.append(bytes_ * (1 + tunables.TIE_BREAK * tie_break))
        compute = np.array(
            [0.0 if saved_bytes[i] else cost[op].compute for i, op in enumerate(ops)]
        )
        gradients = _held_gradients(view, position) if view.gradients_held else np.zeros(len(ops))
        saved_before = np.concatenate([[0.0], np.cumsum(saved_bytes)[:-1]])
        return cls(
            ops, held, compute, gradients, saved_before, tuple(tensors),
            np.array(made, dtype=int),
            np.array(last, dtype=int), np.array(weight, dtype=float),
        )  # fmt: skip

    def segment_peak(self, start: int = 0, end: int | None = None) -> float:
        """The model's peak while backprop works through ops [start, end) as one segment:
        as it reaches each op, what that op and the ops before it hold, and the gradients
        made so far."""
        held = np.cumsum(self.held[start:end])
        return float((held + self.gradients[start:end]).max(initial=0.0))

    def least_peak(self, start: int = 0, end: int | None = None) -> float:
        """No cuts of ops [start, end) get below this: an op's held bytes and the gradients
        made by the time backprop reaches it."""
        return float((self.held[start:end] + self.gradients[start:end]).max(initial=0.0))

    def cut_costs(self, start: int, end: int) -> np.ndarray:
        """For each cut inside ops [start, end), what keeping the tensors made inside and read
        later inside costs the model."""
        lo, hi = np.searchsorted(self.made, [start, end])
        inside = slice(lo, hi)
        keep = self.last[inside] < end
        delta = np.zeros(end - start + 1)
        np.add.at(delta, self.made[inside][keep] - start, self.weight[inside][keep])
        np.add.at(delta, self.last[inside][keep] - start, -self.weight[inside][keep])
        return np.cumsum(delta)[: max(end - start - 1, 0)]

    def held_before(self, start: int, end: int) -> np.ndarray:
        """For each op of [start, end), the saved bytes backprop holds from before it."""
        return self.saved_before[start:end] - (self.saved_before[start] if end > start else 0)


def smallest_peak(order: Order, start: int = 0, end: int | None = None) -> tuple[Cuts, float]:
    """The one-level cuts of ops [start, end) with the smallest model peak, and that peak."""
    end = len(order.ops) if end is None else end
    held, gradients = order.held[start:end], order.gradients[start:end]
    cut_cost = order.cut_costs(start, end)
    best: list[int] = []
    low, high = order.least_peak(start, end), order.segment_peak(start, end)
    for _ in range(tunables.BISECTION_STEPS if len(held) > 1 else 0):
        peak = (low + high) / 2
        found = _cuts_within(held, gradients, cut_cost, peak, order.held_before(start, end))
        if found is None:
            low = peak
        else:
            best, high = found, peak
    return _flat(best, start), high


def within(
    order: Order,
    peak: float,
    start: int = 0,
    end: int | None = None,
    nesting: int = tunables.MAX_NESTING,
    cheaper_than: float = np.inf,
) -> Cuts | None:
    """The cuts of ops [start, end) that recompute least while the model peak stays within
    `peak`, nesting up to `nesting` levels inside; None if none fit, or none recomputes less
    than `cheaper_than` (the search drops plans that cannot beat the best one found so far)."""
    end = len(order.ops) if end is None else end
    if peak < order.least_peak(start, end):
        return None
    searched = order.searched.setdefault((start, end, nesting), [])
    for earlier in searched:
        if (known := earlier.answer(peak, cheaper_than)) is not _Unknown.ANSWER:
            return known
    cuts, work = _search(order, peak, start, end, nesting, cheaper_than)
    searched.append(_Searched(peak, cheaper_than, cuts, work))
    return cuts


class _Unknown(enum.Enum):
    """What an earlier search cannot answer."""

    ANSWER = enum.auto()


@dataclasses.dataclass(frozen=True)
class _Searched:
    """What `within` found for one segment and nesting at `peak`, among cuts recomputing less
    than `cheaper_than`: `cuts` recomputing `work`, or None (and infinite work).

    Where none fit, none fit a smaller peak among cuts recomputing less still. Cuts found are
    reused at the same peak only: the search tries top-level peaks in proportion to the
    target, so at a smaller target it may find cheaper cuts than it did at a larger one.
    """

    peak: float
    cheaper_than: float
    cuts: Cuts | None
    work: float

    def answer(self, peak: float, cheaper_than: float) -> Cuts | _Unknown | None:
        if self.cuts is None:
            return (
                None
                if peak <= self.peak and cheaper_than <= self.cheaper_than
                else _Unknown.ANSWER
            )
        if peak == self.peak:
            return self.cuts if self.work < cheaper_than else None
        return _Unknown.ANSWER


def _search(order, peak, start, end, nesting, cheaper_than) -> tuple[Cuts | None, float]:
    """`within`, searched, with what the cuts found recompute: one level if it fits, else
    top-level cuts for ever larger peaks (`tunables.NESTING_SCALES`) with their segments
    planned within the target in turn, until a peak does no better than the one before
    (larger top-level peaks leave larger segments to nest, and recompute more from there on)."""
    held, gradients = order.held[start:end], order.gradients[start:end]
    cut_cost = order.cut_costs(start, end)
    before = order.held_before(start, end)
    flat = _cuts_within(held, gradients, cut_cost, peak, before, longest_last_segment=True)
    if flat is not None or nesting == 0 or end - start < 3:
        if flat is None:
            return None, np.inf
        cuts = _flat(flat, start)
        work = recompute_work(order, cuts, start, end)
        return (cuts, work) if work < cheaper_than else (None, np.inf)
    best, work = None, np.inf
    for scale in tunables.NESTING_SCALES:
        top = _cuts_within(held, gradients, cut_cost, scale * peak, before, last_peak=peak)
        if not top:
            continue
        plan = _nest(order, start, end, top, cut_cost, peak, nesting - 1, cheaper_than)
        if plan is not None:
            best, work = plan, recompute_work(order, plan, start, end)
            cheaper_than = work
        elif best is not None:
            break
    return best, work


def _nest(order, start, end, top, cut_cost, peak, nesting, cheaper_than) -> Cuts | None:
    """`top` cuts with each segment but the last (which already fits) planned within what the
    cuts before it leave of `peak`, if together they recompute less than `cheaper_than`."""
    bounds = [start, *(start + c + 1 for c in top), end]
    spent = np.concatenate([[0.0], np.cumsum(cut_cost[top])])
    work = order.compute[start : bounds[-2]].sum()
    inner: list[Cuts | None] = []
    for j in range(len(bounds) - 1):
        if work >= cheaper_than:
            return None
        a, b = bounds[j], bounds[j + 1]
        if j == len(bounds) - 2 or spent[j] + order.segment_peak(a, b) <= peak:
            inner.append(None)
            continue
        nested = within(order, peak - spent[j], a, b, nesting, cheaper_than - work)
        if nested is None:
            return None
        work += recompute_work(order, nested, a, b)
        inner.append(nested)
    return Cuts(tuple(start + c for c in top), tuple(inner))


def recompute_work(order: Order, cuts: Cuts, start: int = 0, end: int | None = None) -> float:
    """Forward compute (FLOPs, or measured seconds) that backprop with `cuts` repeats: every
    segment but the last is recomputed once, plus what its own nested cuts repeat inside it."""
    end = len(order.ops) if end is None else end
    bounds = [start, *(p + 1 for p in cuts.positions), end]
    work = 0.0
    for j in range(len(bounds) - 2):
        a, b = bounds[j], bounds[j + 1]
        work += order.compute[a:b].sum()
        if (nested := cuts.inner[j]) is not None:
            work += recompute_work(order, nested, a, b)
    return work


def checkpoints_of(order: Order, cuts: Cuts) -> tuple[tuple[tf.Tensor, ...], ...]:
    """The tensors each level of `cuts` keeps: those alive across its cuts."""
    levels: list[dict] = []

    def collect(c: Cuts, depth: int, start: int, end: int) -> None:
        while len(levels) <= depth:
            levels.append({})
        for p in c.positions:
            lo, hi = np.searchsorted(order.made, [start, p + 1])
            for i in range(lo, hi):
                if order.last[i] > p and (depth == 0 or order.last[i] < end):
                    levels[depth][order.tensors[i].ref()] = order.tensors[i]
        bounds = [start, *(p + 1 for p in c.positions), end]
        for j, nested in enumerate(c.inner):
            if nested is not None:
                collect(nested, depth + 1, bounds[j], bounds[j + 1])

    collect(cuts, 0, 0, len(order.ops))
    return tuple(tuple(level.values()) for level in levels)


def model_peak(order: Order, cuts: Cuts, start: int = 0, end: int | None = None) -> float:
    """The model's peak with `cuts`: the largest cuts-before plus (nested) segment."""
    end = len(order.ops) if end is None else end
    cut_cost = order.cut_costs(start, end)
    bounds = [start, *(p + 1 for p in cuts.positions), end]
    spent = np.concatenate([[0.0], np.cumsum(cut_cost[[p - start for p in cuts.positions]])])
    peak = 0.0
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        nested = cuts.inner[j]
        inside = order.segment_peak(a, b) if nested is None else model_peak(order, nested, a, b)
        peak = max(peak, spent[j] + inside)
    return peak


def _flat(positions: Sequence[int], start: int) -> Cuts:
    return Cuts(tuple(start + p for p in positions), (None,) * (len(positions) + 1))


def _held_gradients(view: ForwardView, position: dict[tf.Operation, int]) -> np.ndarray:
    """`Order.gradients` for gradients held to the end of the step. The gradient of each of
    `Execution.gradients_of_xs` exists once backprop reaches the last recomputable op reading it
    (the end of the pass where none does)."""
    gradients = np.zeros(len(position))
    for tensor in execution_of(view).gradients_of_xs:
        if tensor.dtype.is_floating:
            readers = [position[op] for op in view.consumers(tensor) if op in position]
            gradients[: max(readers, default=len(position) - 1) + 1] += kernels.tensor_bytes(
                tensor
            )
    return gradients


def _read_by_bias_add(tensor: tf.Tensor) -> bool:
    """Whether `tensor` is read only as the value a BiasAdd adds a bias to (a convolution's or
    matmul's output), which graph optimizers fuse with its producer (`tunables.FUSION_SPLIT`)."""
    readers = tensor.consumers()
    return bool(readers) and all(
        r.type == "BiasAdd" and r.inputs[0].ref() == tensor.ref() for r in readers
    )


def _read_by_gradients(view: ForwardView, cost: dict[tf.Operation, costs.OpCost]) -> set:
    """Refs of the tensors some gradient of the view reads."""
    return {
        t.ref()
        for op in view.ops
        for t in (
            *(op.inputs[i] for i in cost[op].saved_inputs),
            *(op.outputs[i] for i in cost[op].saved_outputs),
        )
    }


def _cuts_within(
    held: np.ndarray,
    gradients: np.ndarray,
    cut_cost: np.ndarray,
    peak: float,
    saved_before: np.ndarray | None = None,
    longest_last_segment: bool = False,
    last_peak: float | None = None,
) -> list[int] | None:
    """The cheapest cuts for which every segment, with the cuts before it, the tensors saved
    before it (`saved_before`, by op) and the gradients made so far, fits in `peak` (the last
    one in `last_peak`, if given), or None if no cuts do; with `longest_last_segment`, the
    cheapest of those whose last segment starts earliest.

    State s stands for "a segment starts at op s", reached with cuts costing `spent[s]` before
    it (state 0, the start of the pass, costs nothing). While backprop in the segment from s
    through op i reaches op k, it holds spent[s] + held[s..k] + gradients[k]; the segment fits
    while that is within `peak` for every k in s..i (saved_before[s] is added to each: what
    is saved before the segment stays). As i grows a state only ever stops
    fitting, so states leave a heap ordered by spent[s] - held[..s] once, and the cheapest
    fitting state comes from a second heap: O(n log n).
    """
    n = len(held)
    if n == 0:
        return []
    held_before = np.concatenate([[0.0], np.cumsum(held)])
    # Plain floats and lists: the loop reads one element at a time, where numpy's are slow.
    limits = (peak - held_before[1:] - gradients).tolist()
    before = np.zeros(n + 1) if saved_before is None else np.append(saved_before, 0.0)
    slack_base = (held_before - before).tolist()
    costs_ = cut_cost.tolist()
    spent = [0.0] * n
    previous = [0] * n
    fits = [False] * n
    by_slack: list[tuple[float, int]] = []  # (-(spent - held_before), state): least slack first
    by_cost: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    fits[0] = True
    push(by_slack, (0.0, 0))
    push(by_cost, (0.0, 0))
    for i in range(n):
        limit = limits[i]
        while by_slack and -by_slack[0][0] > limit:
            fits[pop(by_slack)[1]] = False
        while by_cost and not fits[by_cost[0][1]]:
            pop(by_cost)
        if not by_cost:
            return None
        if i == n - 1:
            break
        cheapest, state = by_cost[0]
        spent[i + 1] = cost = cheapest + costs_[i]
        previous[i + 1] = state
        fits[i + 1] = True
        push(by_slack, (slack_base[i + 1] - cost, i + 1))
        push(by_cost, (cost, i + 1))
    starts_fitting = np.array(fits)
    if last_peak is not None:
        reached = np.maximum.accumulate((held_before[1:] + gradients)[::-1])[::-1]
        starts_fitting &= np.array(spent) + before[:n] + reached - held_before[:n] <= last_peak
        if not starts_fitting.any():
            return None
        state = (
            int(np.argmax(starts_fitting))
            if longest_last_segment
            else int(np.argmin(np.where(starts_fitting, spent, np.inf)))
        )
    else:
        state = int(np.argmax(starts_fitting)) if longest_last_segment else by_cost[0][1]
    cuts = []
    while state > 0:
        cuts.append(state - 1)
        state = previous[state]
    return cuts[::-1]
