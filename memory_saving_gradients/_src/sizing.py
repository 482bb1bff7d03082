"""The largest value of a size whose training step fits a memory limit, in few measured steps.

Every probe builds and measures a step, which takes seconds to minutes, so the search takes
few: activation memory grows about linearly in each size (batch, depth, sequence length), so
two fitting values give a line whose crossing of the limit is the next probe, and once a value
fails, the crossing of the line through the bracket's ends, halving the bracket instead from
the first time a line fails to halve it (peaks come in allocator chunks, so lines miss near
the limit). Steps above the limit are probed at most a few times the largest fitting value,
since on CPU they really allocate what they need.

`memory-saving-gradients fit` searches the command's models with it, and
`memory_saving_gradients.keras.largest` a user's own Keras model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

#: The most a probe above the largest fitting value may multiply it by: with one fitting
#: value (no line yet), and with a line.
GROWTH_UNGUIDED = 2
GROWTH_GUIDED = 4


@dataclasses.dataclass(frozen=True)
class Probe:
    """One value measured.

    Attributes:
      value: the size the step was built at.
      fits: whether it fits the limit.
      activation_mib: its measured activation peak; None where it ran out of memory.
      step_s: its median seconds per step; None where it did not run.
      failure: why the method cannot run at all (keras.RematScope raising); None if it ran.
    """

    value: int
    fits: bool
    activation_mib: float | None = None
    step_s: float | None = None
    failure: str | None = None


@dataclasses.dataclass(frozen=True)
class Answer:
    """What the search found for one contender.

    Attributes:
      method: its name, as tables show it.
      largest: the largest value that fits; None where none does or the method cannot run.
      fitting: the probe of `largest`.
      failing: the probe of the smallest failing value above it (`largest + 1` unless
        `capped`); None where none failed.
      capped: `largest` is the most the search may try (its upper bound).
      probes: every probe, in the order taken.
      note: why there is no answer ("does not apply: ...", "fails: ..."), else "".
    """

    method: str
    largest: int | None
    fitting: Probe | None
    failing: Probe | None
    capped: bool
    probes: tuple[Probe, ...]
    note: str = ""


def search(
    probe: Callable[[int], Probe],
    limit_mib: float,
    first: int,
    lower: int,
    upper: int,
    method: str = "",
) -> Answer:
    """The largest value in [`lower`, `upper`] that `probe` says fits, taken to fit up to
    some value and not beyond; `limit_mib` guides the guesses from measured peaks.

    From `first`, shrunk until a value fits (`_shrunk`), the search grows along the line
    through the two largest fitting values (at most `GROWTH_GUIDED` times the largest at
    once), then narrows the bracket between the largest fitting value and the smallest
    failing one, along the line through its ends until that fails to halve it, then by
    halving.
    """
    probes: dict[int, Probe] = {}

    def at(value: int) -> Probe:
        if value not in probes:
            probes[value] = probe(value)
        return probes[value]

    def answer(lo: int | None, hi: int | None, note: str = "") -> Answer:
        return Answer(
            method,
            lo,
            probes[lo] if lo is not None else None,
            probes[hi] if hi is not None else None,
            lo == upper,
            tuple(probes.values()),
            note,
        )

    value = min(max(first, lower), upper)
    hi: int | None = None
    while not at(value).fits:
        if at(value).failure:
            return answer(None, None, f"fails: {at(value).failure}")
        hi = value
        if value == lower:
            return answer(None, hi, "none fits")
        value = _shrunk(probes[value], limit_mib, lower)
    lo = value
    bisecting = False
    while lo < upper and (hi is None or hi - lo > 1):
        width = None if hi is None else hi - lo
        if hi is None:
            guess = _extrapolated(probes, lo, limit_mib, upper)
        elif bisecting:
            guess = (lo + hi) // 2
        else:
            guess = _interpolated(probes[lo], probes[hi], limit_mib)
        guess = min(max(guess, lo + 1), upper if hi is None else hi - 1)
        result = at(guess)
        if result.failure:
            return answer(None, None, f"fails: {result.failure}")
        if result.fits:
            lo = guess
        else:
            hi = guess
        bisecting = bisecting or (width is not None and hi is not None and 2 * (hi - lo) > width)
    return answer(lo, hi)


def _shrunk(failing: Probe, limit_mib: float, lower: int) -> int:
    """Below a failing value: its share of it that the limit is of its peak (activation
    memory is about proportional to each size), or half of it where it has no peak."""
    peak = failing.activation_mib
    share = limit_mib / peak if peak else 0.5
    return max(lower, min(failing.value - 1, math.floor(share * failing.value)))


def _extrapolated(probes: dict[int, Probe], lo: int, limit_mib: float, upper: int) -> int:
    """Where the line through the two largest fitting values reaches `limit_mib`, at most
    `GROWTH_GUIDED` times `lo`. Without such a line, `lo` scaled by the limit over its peak
    (peaks that grow faster than the size, such as attention's with sequence length, are not
    overshot by much), at most `GROWTH_UNGUIDED` times `lo`, and that where the scaled value
    is not above `lo` (a peak at the limit)."""
    fitting = sorted(v for v, p in probes.items() if p.fits and p.activation_mib is not None)
    peak_lo = probes[lo].activation_mib
    unguided = GROWTH_UNGUIDED * lo
    if peak_lo and lo * limit_mib / peak_lo >= lo + 1:
        unguided = min(unguided, math.floor(lo * limit_mib / peak_lo))
    if len(fitting) < 2:
        return min(upper, unguided)
    a, b = fitting[-2:]
    peak_a, peak_b = probes[a].activation_mib, probes[b].activation_mib
    assert peak_a is not None and peak_b is not None
    if peak_b <= peak_a:
        return min(upper, unguided)
    crossing = b + math.floor((limit_mib - peak_b) * (b - a) / (peak_b - peak_a))
    return min(upper, GROWTH_GUIDED * lo, crossing)


def _interpolated(fitting: Probe, failing: Probe, limit_mib: float) -> int:
    """Where the line between a fitting and a failing probe reaches `limit_mib`; their
    midpoint where the failing one has no peak (it ran out of memory) or no higher one."""
    low, high = fitting.activation_mib, failing.activation_mib
    if low is None or high is None or high <= low:
        return (fitting.value + failing.value) // 2
    share = (limit_mib - low) / (high - low)
    return fitting.value + math.floor(share * (failing.value - fitting.value))
