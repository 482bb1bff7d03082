"""Choose checkpoints that minimise the estimated peak memory of the backward pass.

Cut a topological order of the recomputable ops at any point, and the tensors alive across
that point (made before it, read after it) separate the two halves: keeping them lets the half
after the cut be recomputed without the half before. The single-tensor cuts are the
"bottlenecks" of the original library; a cut may hold several tensors (skip connections, dense
blocks), so a plan exists for every graph.

Backprop runs over the segments between cuts from last to first. While it differentiates a
segment it holds that segment's recomputed activations plus the cuts before it: the cuts after
it are spent. So the peak is the largest, over segments, of "cuts before + segment", and the
best plans make segments shorter towards the end. On a uniform chain of n layers the optimum
keeps about sqrt(2n) tensors in segments that shrink by one layer each, for a peak of about
sqrt(2n) activations, where equal segments (Chen et al. 2016) need 2 sqrt(n).

For a candidate peak, a dynamic programme over the order finds whether cuts meet it, and the
cheapest such cuts; a bisection finds the smallest peak that can be met.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np
import tensorflow as tf

from memory_saving_gradients import graph
from memory_saving_gradients.view import ForwardView

#: Op types whose registered gradient reads the op's outputs but not its inputs.
GRADIENT_READS_OUTPUTS = frozenset(
    {"Elu", "Exp", "Relu", "Relu6", "Rsqrt", "Selu", "Sigmoid", "Softmax", "Sqrt", "Tanh"}
)
#: Op types whose registered gradient reads no input or output values (static shapes at most).
GRADIENT_READS_NOTHING = frozenset(
    {
        "Add", "AddN", "AddV2", "BiasAdd", "BroadcastTo", "Cast", "ConcatV2", "ExpandDims",
        "Identity", "IdentityN", "Mean", "Neg", "Pack", "Pad", "Reshape", "Slice", "Snapshot",
        "Split", "SplitV", "Squeeze", "StopGradient", "StridedSlice", "Sub", "Sum", "Transpose",
        "Unpack",
    }
)  # fmt: skip

#: Bisection steps on the peak: the result is within 2**-30 of the best peak the model allows.
BISECTION_STEPS = 30
#: Among cuts of equal size, prefer those made of tensors backprop would not hold anyway (a
#: matmul output read only by a tanh): they die as soon as the recomputation past them starts,
#: while a held one (the tanh output) lives on until its readers' gradients are done.
TIE_BREAK = -1e-3


@dataclasses.dataclass(frozen=True)
class Plan:
    """Checkpoints for one view, with the estimates that chose them (bytes)."""

    checkpoints: tuple[tf.Tensor, ...]
    estimated_peak: int
    estimated_peak_without_checkpoints: int


def plan_checkpoints(view: ForwardView, peak_fraction: float | None = None) -> Plan:
    """The cuts of `view` that give the smallest estimated peak; none if cutting does not pay.

    With `peak_fraction`, the cuts that recompute the least while the estimated peak stays
    within that fraction of plain backprop's: everything before the last cut is recomputed
    once, so these are the cuts with the earliest last cut that fit. Where no cuts fit, the
    smallest peak's.
    """
    order = [op for op in view.ops if op in view.recomputable]
    if not order:
        return Plan((), 0, 0)
    held, cut_bytes, unheld_cut_bytes, lifetimes = _costs(view, order)
    plain_peak = float(held.sum())
    cut_cost = cut_bytes + TIE_BREAK * unheld_cut_bytes
    cuts, peak = None, plain_peak
    if peak_fraction is not None:
        peak = peak_fraction * plain_peak
        cuts = _cuts_within(held, cut_cost, peak, longest_last_segment=True)
    if cuts is None:
        cuts, peak = _smallest_peak_cuts(held, cut_cost)
    chosen = {
        tensor.ref(): tensor
        for cut in cuts
        for tensor, made_at, last_read_at in lifetimes
        if made_at <= cut < last_read_at
    }
    return Plan(tuple(chosen.values()), int(peak), int(plain_peak))


def _smallest_peak_cuts(held: np.ndarray, cut_cost: np.ndarray) -> tuple[list[int], float]:
    """Bisect on the peak: the cheapest cuts meeting the smallest peak, and that peak."""
    best_cuts: list[int] = []
    low, high = float(held.max(initial=0.0)), float(held.sum())
    for _ in range(BISECTION_STEPS if len(held) > 1 else 0):
        peak = (low + high) / 2
        cuts = _cuts_within(held, cut_cost, peak)
        if cuts is None:
            low = peak
        else:
            best_cuts, high = cuts, peak
    return best_cuts, high


def _held_for_backward(op: tf.Operation, readers: list[tf.Operation]) -> bool:
    """Whether some gradient function reads this output of `op`, so backprop must hold it."""
    if op.type in GRADIENT_READS_OUTPUTS:
        return True
    not_reading_inputs = GRADIENT_READS_OUTPUTS | GRADIENT_READS_NOTHING
    return any(reader.type not in not_reading_inputs for reader in readers)


def _costs(view: ForwardView, order: list[tf.Operation]):
    """Bytes each op's outputs hold for backprop; bytes alive across each cut, all and those
    backprop would not hold anyway; tensor lifetimes.

    Cut `i` lies between `order[i]` and `order[i + 1]`. A lifetime is (tensor, index of its
    producer, index of its last reader); the view's ys live to the end.
    """
    position = {op: i for i, op in enumerate(order)}
    always_kept = {t.ref() for t in view.must_keep}
    ys = {y.ref() for y in view.ys}
    end = len(order) - 1
    held = np.zeros(len(order))
    alive_delta = np.zeros(len(order) + 1)
    unheld_delta = np.zeros(len(order) + 1)
    lifetimes = []
    for i, op in enumerate(order):
        for tensor in op.outputs:
            if tensor.ref() in always_kept:
                continue
            readers = view.consumers(tensor)
            size = graph.size_in_bytes(tensor)
            is_held = _held_for_backward(op, readers)
            held[i] += size * is_held
            last_read = max((position[r] for r in readers if r in position), default=i)
            if tensor.ref() in ys:
                last_read = end
            if last_read > i:
                alive_delta[i] += size
                alive_delta[last_read] -= size
                unheld_delta[i] += size * (not is_held)
                unheld_delta[last_read] -= size * (not is_held)
                lifetimes.append((tensor, i, last_read))
    return held, np.cumsum(alive_delta)[:end], np.cumsum(unheld_delta)[:end], lifetimes


def _cuts_within(
    held: np.ndarray, cut_cost: np.ndarray, peak: float, longest_last_segment: bool = False
) -> list[int] | None:
    """The cheapest cuts for which every segment plus the cuts before it fits in `peak`, or
    None if no cuts do; with `longest_last_segment`, the cheapest of those whose last segment
    starts earliest.

    State s stands for "a segment starts at op s", reached with cuts costing `spent[s]` before
    it (state 0, the start of the pass, costs nothing). The segment from s through op i fits
    while spent[s] + held[s..i] <= peak. As i grows a state only ever stops fitting, so states
    leave a heap ordered by that condition once, and the cheapest fitting state comes from a
    second heap: O(n log n).
    """
    n = len(held)
    held_before = np.concatenate([[0.0], np.cumsum(held)])
    spent = np.zeros(n)
    previous = np.zeros(n, dtype=int)
    fits = np.zeros(n, dtype=bool)
    by_slack: list[tuple[float, int]] = []  # (-(spent - held_before), state): least slack first
    by_cost: list[tuple[float, int]] = []
    fits[0] = True
    heapq.heappush(by_slack, (0.0, 0))
    heapq.heappush(by_cost, (0.0, 0))
    for i in range(n):
        limit = peak - held_before[i + 1]
        while by_slack and -by_slack[0][0] > limit:
            fits[heapq.heappop(by_slack)[1]] = False
        while by_cost and not fits[by_cost[0][1]]:
            heapq.heappop(by_cost)
        if not by_cost:
            return None
        if i == n - 1:
            break
        spent[i + 1] = by_cost[0][0] + cut_cost[i]
        previous[i + 1] = by_cost[0][1]
        fits[i + 1] = True
        heapq.heappush(by_slack, (-(spent[i + 1] - held_before[i + 1]), i + 1))
        heapq.heappush(by_cost, (spent[i + 1], i + 1))
    cuts = []
    state = int(np.argmax(fits)) if longest_last_segment else by_cost[0][1]
    while state > 0:
        cuts.append(state - 1)
        state = previous[state]
    return cuts[::-1]
