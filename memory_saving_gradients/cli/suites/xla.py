"""Peak memory and step time of checkpointed gradients under XLA (`jit_compile=True`).

Two workloads, each plain and 'memory', each with XLA off and on: an SGD step on the
catalogue's tanh(matmul) chain (`cli.measure`'s training step, compiled whole), and Keras
`train_on_batch` of a Sequential of tanh Dense layers compiled with `jit_compile`, plain or
after `msg.keras.enable`. Activation memory is the allocator's peak above resident memory.
TensorFlow's CPU allocator counts a block it does not split whole, so a peak depends on what
ran before: each point is measured in two fresh processes, as the allocator starts ("fresh
process", what a training script sees) and once one free block far larger than the step was
made, from which each request is cut to its size ("grown allocator": what the step needs).
For steps XLA compiles, the size of XLA's own buffers (its buffer assignment, read from an XLA
dump: the temporary buffer and the outputs that alias no input) is given too. Step times are
the medians of each turn's ratio of 'memory''s XLA step to plain's, taken in turns in one
process (`msg.profiling.step_time_ratios`).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Any

from memory_saving_gradients.cli import runtime
from memory_saving_gradients.cli.suites import isolated
from memory_saving_gradients.cli.suites.page import Page, number, progress

TITLE = "Under XLA"
MIB = 2**20
#: MiB of the free block a "grown" point's process makes first.
GROWN_MIB = 512
METHOD = "memory"


@dataclasses.dataclass(frozen=True)
class Size:
    """Layers and width of each workload, the batch, and turns timed (`step_time_ratios`)."""

    workloads: tuple[str, ...]
    chain_depth: int
    keras_depth: int
    width: int
    batch: int
    repeats: int


FULL = Size(("chain", "keras"), 32, 24, 512, 1024, 7)
QUICK = Size(("chain",), 8, 4, 128, 512, 2)


def run(page: Page, quick: bool, device: str) -> None:
    size = QUICK if quick else FULL
    page.text(
        f"Batch {size.batch}, float32, on {device}; chain: {size.chain_depth} tanh(matmul) "
        f"layers of {size.width}; keras: {size.keras_depth} tanh Dense layers of "
        f"{size.width} and a Dense(1) head, SGD. MiB above resident memory, each point in a "
        f"fresh process: as its allocator starts, and once grown by {GROWN_MIB} MiB; "
        f"*time*: the median of {size.repeats} turns' ratios of an XLA step's time to plain "
        "XLA's in the same turn."
    )
    rows = []
    for workload in size.workloads:
        found = {}
        for jit in (False, True):
            for method in ("plain", METHOD):
                progress(f"xla: {workload}, XLA {'on' if jit else 'off'}, {method}")
                found[jit, method] = {
                    allocator: _point(size, workload, jit, method, allocator, device)
                    for allocator in ("fresh", "grown")
                }
        time_ratio = _time_ratio(size, workload, device)
        for jit in (False, True):
            plain, kept = found[jit, "plain"], found[jit, METHOD]
            rows.append(
                [
                    workload,
                    "on" if jit else "off",
                    *(
                        cell
                        for allocator in ("fresh", "grown")
                        for cell in (
                            f"{plain[allocator]['peak']:.1f}",
                            f"{kept[allocator]['peak']:.1f}",
                            f"{kept[allocator]['peak'] / plain[allocator]['peak']:.2f}",
                        )
                    ),
                    number(plain["grown"]["xla"], "{:.1f}"),
                    number(kept["grown"]["xla"], "{:.1f}"),
                    f"{time_ratio:.2f}x" if jit else "",
                ]
            )
    page.table(
        [
            "workload", "XLA", "fresh: plain MiB", f"fresh: '{METHOD}'", "ratio",
            "grown: plain MiB", f"grown: '{METHOD}'", "ratio", "XLA buffers: plain MiB",
            f"XLA buffers: '{METHOD}'", "time / plain XLA",
        ],
        rows,
    )  # fmt: skip


def _point(
    size: Size, workload: str, jit: bool, method: str, allocator: str, device: str
) -> dict[str, Any]:
    """`measure_point` in a fresh interpreter, with XLA dumping its buffer assignment."""
    with tempfile.TemporaryDirectory(prefix="msg_xla_") as dump:
        return isolated.run_alone(
            "xla:measure_point",
            env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"},
            size=dataclasses.asdict(size),
            workload=workload,
            jit=jit,
            method=method,
            grown=allocator == "grown",
            device=device,
            dump=dump,
        )


def measure_point(
    size: dict[str, Any],
    workload: str,
    jit: bool,
    method: str,
    grown: bool,
    device: str,
    dump: str,
) -> dict[str, Any]:
    """One point's peak and XLA buffers, in this fresh interpreter."""
    from memory_saving_gradients.profiling import peak_memory

    if grown:
        runtime.grow_allocator(GROWN_MIB, device)
    run = _STEPS[workload](Size(**size), method, jit)
    peak = peak_memory(run, device) / MIB
    return {"peak": peak, "xla": _xla_buffer_mib(Path(dump)) if jit else None}


def _time_ratio(size: Size, workload: str, device: str) -> float:
    """'memory''s XLA step time over plain XLA's, from steps taken in turns here."""
    from memory_saving_gradients.profiling import step_time_ratios

    runs = {method: _STEPS[workload](size, method, True) for method in ("plain", METHOD)}
    return step_time_ratios(runs, "plain", size.repeats)[METHOD].median


def _chain_step(size: Size, method: str, jit: bool) -> Any:
    """The SGD step of `cli.measure` on a fresh chain, compiled by XLA where `jit`."""
    import tensorflow as tf

    from memory_saving_gradients._src.models import command as models
    from memory_saving_gradients.cli import measure

    model = models.build("chain", size.chain_depth, models.Shape(size.batch, size.width, 0))
    checkpoints = None if method == "plain" else method
    step = tf.function(
        lambda: measure.train(model, models.unwrapped, checkpoints), jit_compile=jit
    )
    return lambda: step().numpy()


def _keras_step(size: Size, method: str, jit: bool) -> Any:
    """`train_on_batch` of a fresh Sequential of tanh Dense layers."""
    import keras
    import numpy as np

    import memory_saving_gradients as msg

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((size.width,))]
        + [keras.layers.Dense(size.width, activation="tanh") for _ in range(size.keras_depth)]
        + [keras.layers.Dense(1)]
    )
    if method != "plain":
        msg.keras.enable(model, checkpoints=method)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((size.batch, size.width)).astype("f4")
    y = rng.standard_normal((size.batch, 1)).astype("f4")
    return lambda: model.train_on_batch(x, y)


_STEPS = {"chain": _chain_step, "keras": _keras_step}


def _xla_buffer_mib(dump: Path) -> float:
    """XLA's temporary buffer plus the outputs that alias no input, of the largest module in
    `dump`, in MiB (from XLA's buffer assignment)."""
    sizes = [0]
    for report in dump.glob("*buffer-assignment.txt"):
        total = 0
        for line in report.read_text().splitlines():
            found = re.match(r"allocation \d+: size (\d+), (.*)", line)
            if found and (
                "preallocated-temp" in found[2]
                or ("maybe-live-out" in found[2] and "parameter" not in found[2])
            ):
                total += int(found[1])
        sizes.append(total)
    return max(sizes) / MIB
