"""The largest batch, depth or sequence length whose training step fits a memory limit.

The question checkpointing answers for a user is "how much bigger can I train in my memory",
so `fit` searches, for each way of computing gradients, the largest value of one size that
fits. Every probe is a step measured as `bench` measures it (`measure.sweep`: a fresh model
and `tf.function`, the allocator's peak above resident memory), so the answers are of the
same steps as bench's tables.

On CPU nothing stops a step from allocating more than the limit: a value fits when its
measured activation peak does. On a GPU the limit is real: the device is configured with that
much memory (`start`) and a value fits when its step runs without running out.

Probes are few because activation memory grows about linearly in each size: two fitting
values give a line whose crossing of the limit is the next probe, and once a value fails, the
crossing of the line through the bracket's ends, halving the bracket instead from the first
time a line fails to halve it (peaks come in allocator chunks, so lines miss near the limit).
Steps above the limit are probed at most a few times the largest fitting value, since on CPU
they really allocate what they need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence

from memory_saving_gradients.cli import measure, runtime
from memory_saving_gradients.models import command as models

MIB = measure.MIB
#: keras.RematScope modes `fit` measures, as `--baselines` names them.
REMAT_MODES = {
    "remat-full": "full",
    "remat-activations": "activations",
    "remat-larger": "larger_than",
}
#: Models built of TensorFlow ops alone, which keras.RematScope leaves as they are.
WITHOUT_KERAS_LAYERS = ("chain",)
#: The most a probe above the largest fitting value may multiply it by: with one fitting
#: value (no line yet), and with a line.
GROWTH_UNGUIDED = 2
GROWTH_GUIDED = 4
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way of computing gradients whose largest size is searched.

    Attributes:
      method: how bench computes its gradients.
      remat: the keras.RematScope mode its model is built and traced in; None for none.
    """

    method: measure.Method
    remat: str | None = None

    @property
    def name(self) -> str:
        return f"keras.RematScope({self.remat!r})" if self.remat else self.method.name


def contenders(
    strategies: Sequence[str], budgets: Sequence[float], baselines: Sequence[str]
) -> list[Contender]:
    """Plain first, then the strategies, the budgets, `tf.recompute_grad` and the
    keras.RematScope modes that `baselines` names."""
    chosen = measure.methods(strategies, budgets, [b for b in baselines if b in measure.BASELINES])
    remats = [REMAT_MODES[b] for b in baselines if b in REMAT_MODES]
    return [Contender(method) for method in chosen] + [
        Contender(measure.PLAIN, mode) for mode in remats
    ]


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
      capped: `largest` is the most the search may try (`--max`, or the model's own bound).
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


@dataclasses.dataclass(frozen=True)
class Problem:
    """What is searched: model `model` at `depth` and `shape`, growing `grow` from `lower`
    to `upper`, under `limit_bytes` on `device` ('CPU:0': measured peaks; 'GPU:0': a real
    limit)."""

    model: str
    depth: int
    shape: models.Shape
    grow: str
    limit_bytes: int
    lower: int
    upper: int
    device: str
    setting: measure.Setting

    def resized(self, value: int) -> tuple[int, models.Shape]:
        """The depth and shape of the model with `grow` at `value`."""
        if self.grow == "depth":
            return value, self.shape
        if self.grow == "batch":
            return self.depth, dataclasses.replace(self.shape, batch=value)
        return self.depth, dataclasses.replace(self.shape, size=value)

    def batch_at(self, value: int) -> int:
        """The batch of the model with `grow` at `value`."""
        return value if self.grow == "batch" else self.shape.batch


def upper_bound(model: str, grow: str, size: int, most: int) -> int:
    """The most `grow` may reach: `most`, and for a U-Net's depth, the levels its images can
    be halved into (`size` divisible by 2**(depth - 1))."""
    if model == "unet" and grow == "depth":
        halvings = (size & -size).bit_length() - 1  # the trailing zero bits of size
        return min(most, 1 + halvings)
    return most


def start(device: str, limit_bytes: int) -> str:
    """Start TensorFlow's runtime like `runtime.start`; where the step runs on a GPU, give it
    `limit_bytes` of memory (a logical device), so that a step over the limit runs out of it.

    Raises:
      runtime.NoGpuError: `device` is 'gpu' and TensorFlow sees no GPU.
    """
    import tensorflow as tf

    if device == "cpu":
        return runtime.start("cpu")
    with runtime._stderr_kept_unless_failing():  # CUDA's complaints on CPU-only machines
        gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return runtime.start(device)
    config = tf.config.LogicalDeviceConfiguration(memory_limit=max(1, limit_bytes // MIB))
    tf.config.set_logical_device_configuration(gpus[0], [config])
    return "GPU:0"


def search_all(
    problem: Problem,
    chosen: Sequence[Contender],
    start_value: int,
    progress: Callable[[str], None],
) -> list[Answer]:
    """The answer of each contender. Plain's largest value, where it has one, is where the
    others' searches start: checkpointing seldom fits less (where it does, as
    keras.RematScope's 'activations' may, the search shrinks from there)."""
    answers: list[Answer] = []
    plain_largest: int | None = None
    for contender in chosen:
        reason = _inapplicable(problem.model, contender)
        if reason:
            progress(f"{contender.name}: {reason}")
            answers.append(Answer(contender.name, None, None, None, False, (), reason))
            continue
        first = plain_largest or start_value
        answer = search(
            _prober(problem, contender, progress),
            problem.limit_bytes / MIB,
            first,
            problem.lower,
            problem.upper,
            contender.name,
        )
        if contender.method is measure.PLAIN and contender.remat is None:
            plain_largest = answer.largest
        answers.append(answer)
    return answers


def _inapplicable(model: str, contender: Contender) -> str:
    """Why `contender` does not apply to `model`; "" where it does."""
    if contender.remat and model in WITHOUT_KERAS_LAYERS:
        return f"does not apply: the {model} has no Keras layers"
    if contender.method.needs_blocks and not models.kind_of(model).has_blocks:
        return f"does not apply: {model} is not made of blocks"
    return ""


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


def _prober(
    problem: Problem, contender: Contender, progress: Callable[[str], None]
) -> Callable[[int], Probe]:
    """`probe(value)`: the step of `contender` at `value`, measured as bench measures it."""
    import tensorflow as tf

    method = dataclasses.replace(contender.method, reference=contender.method.name)

    def probe(value: int) -> Probe:
        depth, shape = problem.resized(value)
        began = time.perf_counter()
        try:
            with _remat_scope(contender.remat):
                (point,) = measure.sweep(
                    problem.model, shape, [depth], [method], problem.setting, _ignore
                )
        except tf.errors.ResourceExhaustedError:
            progress(f"{contender.name}: {problem.grow} {value} runs out of memory")
            return Probe(value, fits=False)
        except Exception as error:
            if contender.remat is None:
                raise
            reason = failure_reason(error)
            progress(f"{contender.name}: {problem.grow} {value} fails: {reason}")
            return Probe(value, fits=False, failure=reason)
        fits = problem.device != "CPU:0" or point.activation_mib * MIB <= problem.limit_bytes
        progress(
            f"{contender.name}: {problem.grow} {value}: {point.activation_mib:.1f} MiB, "
            f"{'fits' if fits else 'too much'} ({time.perf_counter() - began:.1f} s)"
        )
        return Probe(value, fits, point.activation_mib, point.step_s)

    return probe


@contextlib.contextmanager
def _remat_scope(mode: str | None) -> Iterator[None]:
    """Inside, Keras layers are made and called under keras.RematScope(`mode`)."""
    if mode is None:
        yield
        return
    import keras

    with keras.RematScope(mode=mode):
        yield


def failure_reason(error: Exception) -> str:
    """The line of `error` that says why: Keras wraps the cause of a layer's failure in a
    traced call's message ("Exception encountered when calling ...")."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    named = [i for i, line in enumerate(lines) if re.match(r"\w+(Error|Exception): ", line)]
    if not named:
        return f"{type(error).__name__}: {lines[0] if lines else ''}"
    at = named[-1]
    if "Exception encountered when calling" in lines[at] and at + 1 < len(lines):
        return f"{lines[at].split(':')[0]}: {lines[at + 1]}"
    return lines[at]


def _ignore(_line: str) -> None:
    """Progress of one probe's inner sweep: `fit` reports each probe itself."""
