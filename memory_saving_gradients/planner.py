"""Choose checkpoints that minimise the estimated peak memory of the backward pass.

Cut a topological order of the recomputable ops at any point, and the tensors alive across
that point (made before it, read after it) separate the two halves: keeping them lets the half
after the cut be recomputed without the half before. The single-tensor cuts are the
"bottlenecks" of the original library; a cut may hold several tensors (skip connections, dense
blocks), so a plan exists for every graph.

For a set of cuts, backprop holds every kept cut plus, while one segment is differentiated,
that segment's recomputed activations (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"). For each segment-size budget, a dynamic programme finds the cheapest cuts that
keep every segment within it; the budget with the smallest estimated peak wins. On a uniform
chain of n layers this keeps about sqrt(n) tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

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

#: Budgets tried between the largest single op and the whole forward pass.
BUDGETS_TRIED = 48
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


def plan_checkpoints(view: ForwardView) -> Plan:
    """The cuts of `view` that give the smallest estimated peak; none if cutting does not pay."""
    order = [op for op in view.ops if op in view.recomputable]
    held, cut_bytes, unheld_cut_bytes, lifetimes = _costs(view, order)
    plain_peak = int(held.sum())
    best_cuts: list[int] = []
    best_peak = plain_peak
    if len(order) > 1:
        smallest = max(held.max(), 1.0)
        budgets = np.geomspace(smallest, max(plain_peak, smallest), BUDGETS_TRIED)
        for budget in budgets.clip(min=smallest):  # geomspace may round below its start
            cuts = _cheapest_cuts(held, cut_bytes + TIE_BREAK * unheld_cut_bytes, budget)
            peak = _estimated_peak(held, cut_bytes, cuts)
            if peak < best_peak:
                best_cuts, best_peak = cuts, peak
    chosen = {
        tensor.ref(): tensor
        for cut in best_cuts
        for tensor, made_at, last_read_at in lifetimes
        if made_at <= cut < last_read_at
    }
    return Plan(tuple(chosen.values()), best_peak, plain_peak)


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


def _cheapest_cuts(held: np.ndarray, cut_bytes: np.ndarray, budget: float) -> list[int]:
    """Cuts of least total size such that no segment holds more than `budget` bytes.

    State k stands for "a segment starts at op k" (state 0, the start of the pass, is free).
    A segment from state k through op i is allowed while it holds at most `budget`, which
    `budget >= held.max()` makes possible for every op. A deque keeps the allowed states in
    increasing order of cost, so the programme is linear.
    """
    n = len(held)
    held_before = np.concatenate([[0.0], np.cumsum(held)])
    cost = np.zeros(n)
    previous = np.zeros(n, dtype=int)
    window: deque[int] = deque([0])
    for i in range(n):
        while held_before[i + 1] - held_before[window[0]] > budget:
            window.popleft()
        if i == n - 1:
            break
        cost[i + 1] = cost[window[0]] + cut_bytes[i]
        previous[i + 1] = window[0]
        while window and cost[window[-1]] >= cost[i + 1]:
            window.pop()
        window.append(i + 1)
    cuts = []
    state = window[0]
    while state > 0:
        cuts.append(state - 1)
        state = previous[state]
    return cuts[::-1]


def _estimated_peak(held: np.ndarray, cut_bytes: np.ndarray, cuts: list[int]) -> int:
    """Every kept cut plus the segment that holds the most while it is differentiated."""
    bounds = [0, *(c + 1 for c in cuts), len(held)]
    largest_segment = max(held[a:b].sum() for a, b in itertools.pairwise(bounds))
    return int(cut_bytes[cuts].sum() + largest_segment)
