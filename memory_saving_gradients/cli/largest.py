"""The largest batch, depth or sequence length whose training step fits a memory limit.

The question checkpointing answers for a user is "how much bigger can I train in my memory",
so `fit` searches, for each way of computing gradients, the largest value of one size that
fits. Every probe is a step measured as `bench` measures it (`measure.sweep`: a fresh model
and `tf.function`, the allocator's peak above resident memory), so the answers are of the
same steps as bench's tables.

Both devices give the steps one pool of memory (`start`). On a GPU the limit is real: the
device is configured with that much memory and a value fits when its step runs without
running out. On CPU nothing stops a step from allocating more than the limit: the allocator
is grown first into a pool far larger than it, and a value fits when its measured activation
peak is within the limit.

The search itself, and why it needs few probes, is `memory_saving_gradients._src.sizing`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Sequence

from memory_saving_gradients._src.models import command as models
from memory_saving_gradients._src.sizing import Answer, Probe, search
from memory_saving_gradients.cli import measure, runtime

MIB = measure.MIB
#: keras.RematScope modes `fit` measures, as `--baselines` names them.
REMAT_MODES = {
    "remat-full": "full",
    "remat-activations": "activations",
    "remat-larger": "larger_than",
}
#: Models built of TensorFlow ops alone, which keras.RematScope leaves as they are.
WITHOUT_KERAS_LAYERS = ("chain",)
#: On the CPU the allocator is first grown by this many times the limit, and at least
#: `CPU_POOL_MIB` (`start`): more than any step that fits and the weights beside it ask.
CPU_POOL_LIMITS = 8
CPU_POOL_MIB = 2048
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
    """Start TensorFlow's runtime like `runtime.start` and give the step one pool of memory,
    as a GPU has: on a GPU, a logical device of `limit_bytes`, so that a step over the limit
    runs out of it; on the CPU, an allocator grown by a block far larger than the limit
    (`CPU_POOL_LIMITS` times it, at least `CPU_POOL_MIB`), from which each request is cut.
    Grown block by block as steps ask, the CPU allocator would hand a request a whole block
    of up to twice its size, and whether a length fits would depend on the blocks earlier
    probes left.

    Raises:
      runtime.NoGpuError: `device` is 'gpu' and TensorFlow sees no GPU.
    """
    import tensorflow as tf

    gpus = []
    if device != "cpu":
        with runtime._stderr_kept_unless_failing():  # CUDA's complaints on CPU-only machines
            gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        started = runtime.start(device)
        runtime.grow_allocator(max(CPU_POOL_MIB, CPU_POOL_LIMITS * limit_bytes // MIB), started)
        return started
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
    if not contender.method.applies_to(models.kind_of(model)):
        return f"does not apply: {model} is not made of such blocks"
    return ""


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
