"""The memory/time frontier of Keras `fit`: strategies and budgets, predicted and measured.

For one model (the residual CNN of `keras_resnet.py`, or any `keras.applications` name built
with weights=None), plain `fit` is compared with each method given: strategies and
`MemoryBudget`s, planned from the static cost model or, with `--measure`, from the first step
measured (`msg.keras.enable(..., measure=True)`). One training step is `train_on_batch` (SGD
with momentum). For each method it prints the activation peak (the allocator's peak above
what was resident before the step; the largest of --steps steps after the warm-up, in the
smallest of --memory-repeats fresh models), its ratio to plain's, the ratio the plan predicted,
and the step time as a ratio to plain's (medians of interleaved steps). It writes
results/fit_frontier_<model>.csv and .png (time ratio against memory ratio).

Each method's peak is measured in a process of its own, as a user training one model has it:
TensorFlow's allocator keeps the blocks a process's earlier steps grew, and hands a request a
free block of up to twice its size whole, so a step run after a larger one (plain) can read
more than it needs. The "shared" column is the same peak read in one process after plain and
the methods before it, where every step is also timed.

    python benchmarks/fit_frontier.py                          # residual CNN, 56 blocks
    python benchmarks/fit_frontier.py --model ResNet50 --size 96 --batch 16 --measure
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from keras_resnet import train_step

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import interleaved_step_times

tf.get_logger().setLevel("ERROR")

MiB = 2**20
PREDICTED = re.compile(r"predicted activation peak ([\d.]+) MiB, ([\d.]+) MiB without")
PREDICTED_TIME = re.compile(r"predicted step time ([\d.]+)x plain")


class Predictions(logging.Handler):
    """The last predicted peak ratio and step-time ratio the library logged."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ratio: float | None = None
        self.time_ratio: float | None = None
        self.mib: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if found := PREDICTED.search(text):
            self.ratio = float(found[1]) / float(found[2])
            self.mib = float(found[1])
        if found := PREDICTED_TIME.search(text):
            self.time_ratio = float(found[1])


def worst_peak(step, steps: int) -> float:
    """The largest activation peak of `steps` steps after a warm-up (which plans)."""
    step()
    peaks = []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - resident)
    return max(peaks) / MiB


def keep_nothing(view: msg.ForwardView) -> msg.Plan:
    """Plain gradients in the enabled step: what its ordering of updates alone saves."""
    return msg.Plan(view, [()], "plain")


def method_of(name: str) -> object:
    """A strategy name, 'plain-ordered' (`keep_nothing`), or a budget written as a fraction
    (0.5)."""
    if name == "plain-ordered":
        return keep_nothing
    try:
        return msg.MemoryBudget(float(name))
    except ValueError:
        return name


def peak_of(args: argparse.Namespace, checkpoints: object, predictions: Predictions) -> dict:
    """The worst peak of `checkpoints`' steps, in the smallest of --memory-repeats fresh
    models, and what its plan predicted."""
    peak = float("inf")
    for _ in range(args.memory_repeats):
        predictions.ratio = predictions.time_ratio = predictions.mib = None
        peak = min(peak, worst_peak(train_step(args, checkpoints), args.steps))
    return {
        "peak": peak,
        "ratio": predictions.ratio,
        "time_ratio": predictions.time_ratio,
        "mib": predictions.mib,
    }


def alone(name: str, argv: list[str]) -> dict:
    """`peak_of` method `name`, measured in a process of its own."""
    command = [sys.executable, __file__, *argv, "--alone", name]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(output.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="residual")
    parser.add_argument("--blocks", type=int, default=56)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["plain-ordered", "speed", "balanced", "0.5", "0.4", "memory"],
    )
    parser.add_argument("--measure", action="store_true", help="plan from the first step")
    parser.add_argument("--memory-repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per model")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per method")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--alone", help=argparse.SUPPRESS)  # a child process measuring one
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy(args.dtype)
    predictions = Predictions()
    library = logging.getLogger("memory_saving_gradients")
    library.addHandler(predictions)
    library.setLevel(logging.INFO)
    library.propagate = False

    methods = {"plain": None, **{name: method_of(name) for name in args.methods}}
    if args.alone is not None:
        print(json.dumps(peak_of(args, methods[args.alone], predictions)))
        return 0
    print(
        f"Keras fit, {args.model} {args.size}x{args.size} batch {args.batch} {args.dtype}, "
        f"costs {'measured' if args.measure else 'static'}",
        flush=True,
    )
    measured = {}
    shared: dict[str, float] = {}
    steps = {}
    for name, checkpoints in methods.items():
        measured[name] = alone(name, argv)
        steps[name] = train_step(args, checkpoints)
        shared[name] = worst_peak(steps[name], args.steps)
        print(f"  {name}: {measured[name]['peak']:.1f} MiB, shared {shared[name]:.1f}", flush=True)
    times = interleaved_step_times(steps, args.repeats)
    median = {name: float(np.median(values)) for name, values in times.items()}
    plain = measured["plain"]["peak"]
    rows = []
    for name in methods:
        found = measured[name]
        ratio, time_ratio, mib = (
            (found["ratio"], found["time_ratio"], found["mib"])
            if name != "plain"
            else (1.0, 1.0, None)
        )
        rows.append(
            {
                "method": name,
                "activation_mib": round(found["peak"], 1),
                "predicted_mib": None if mib is None else round(mib, 1),
                "memory_ratio": round(found["peak"] / plain, 3),
                "predicted_ratio": None if ratio is None else round(ratio, 3),
                "shared_mib": round(shared[name], 1),
                "shared_ratio": round(shared[name] / shared["plain"], 3),
                "time_ratio": round(median[name] / median["plain"], 3),
                "predicted_time_ratio": None if time_ratio is None else round(time_ratio, 3),
                "step_s": round(median[name], 4),
            }
        )
    print(
        "| method | activation MiB | predicted MiB | memory / plain | predicted | "
        "shared / plain | time / plain | predicted |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['method']} | {row['activation_mib']} | {_cell(row['predicted_mib'], 1)} | "
            f"{row['memory_ratio']:.2f} | {_cell(row['predicted_ratio'])} | "
            f"{row['shared_ratio']:.2f} | {row['time_ratio']:.2f}x | "
            f"{_cell(row['predicted_time_ratio'])} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"fit_frontier_{args.model}{'_measured' if args.measure else ''}"
    with open(stem.with_suffix(".csv"), "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, stem.with_suffix(".png"), f"Keras fit, {args.model}")
    print(f"wrote {stem}.csv and {stem}.png")
    return 0


def _cell(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4.5))
    for row in rows:
        axes.scatter(row["memory_ratio"], row["time_ratio"])
        axes.annotate(row["method"], (row["memory_ratio"], row["time_ratio"]), fontsize=8)
    axes.set_xlabel("activation memory / plain")
    axes.set_ylabel("step time / plain")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
