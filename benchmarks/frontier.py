"""The memory/time frontier of checkpointing on a deep chain: budgets against their cost.

Chain of N tanh(matmul) layers (default N=128, width 1024, batch 512, float32), one SGD step
inside a `tf.function`. For plain `tf.gradients`, 'memory', 'balanced', a range of
`MemoryBudget` fractions (above one level's least they recompute less; below it they nest)
and `tf.recompute_grad` around groups of about sqrt(N) layers, it prints the activation memory
(peak above resident, the smallest of --builds fresh builds) and the step time (median of
interleaved steps), both as ratios to plain measured in the same run, with each plan's
predicted ratio beside the measured one. It writes results/frontier.csv and results/frontier.png
(time ratio against memory ratio, one point per method, budgets joined by a line).

    python benchmarks/frontier.py --targets        # about 20 minutes on two CPU cores
    python benchmarks/frontier.py --depth 32 --batch 256 --width 512    # a quick look
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import command as models
from memory_saving_gradients.cli import measure

#: Issue 10: MemoryBudget(0.10) within 0.10 of plain's activation memory at <= 1.8x its time.
TARGET_BUDGET, TARGET_MEMORY, TARGET_TIME = 0.10, 0.10, 1.8
BUDGETS = (0.5, 0.33, 0.25, 0.18, 0.14, 0.10, 0.07)


def predicted_ratios(depth: int, shape: models.Shape, methods) -> dict[str, float]:
    """Each checkpointing method's predicted activation peak over plain's, from its plan."""
    import tensorflow as tf

    model = models.build("chain", depth, shape)
    ratios = {}

    @tf.function
    def trace():
        loss = model.loss(models.unwrapped)
        for method in methods:
            if method.checkpoints is not None:
                plan = msg.plan(loss, list(model.variables), checkpoints=method.checkpoints)
                ratios[method.name] = plan.peak_bytes / plan.plain_peak_bytes
        return loss

    trace.get_concrete_function()
    return ratios


def plot(points, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    budgets = [p for p in points if p.method.startswith("MemoryBudget")]
    axes.plot([p.memory_ratio for p in budgets], [p.time_ratio for p in budgets], "-", color="0.7")
    for point in points:
        axes.plot(point.memory_ratio, point.time_ratio, "o")
        axes.annotate(
            point.method, (point.memory_ratio, point.time_ratio), fontsize=8,
            xytext=(4, 4), textcoords="offset points",
        )  # fmt: skip
    axes.set_xscale("log")
    axes.set_xlabel("activation memory / plain (log)")
    axes.set_ylabel("step time / plain")
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=128)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS))
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per method")
    parser.add_argument(
        "--builds", type=int, default=2, help="fresh builds per method; the smallest peak counts"
    )
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument(
        "--targets", action="store_true", help=f"exit 1 unless MemoryBudget({TARGET_BUDGET}) "
        f"is within {TARGET_MEMORY} of plain's memory at <= {TARGET_TIME}x its time"
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    budgets = sorted({*args.budgets, *([TARGET_BUDGET] if args.targets else [])}, reverse=True)
    shape = models.Shape(args.batch, args.width, size=0)
    chosen = measure.methods(["memory", "balanced"], budgets, ["recompute_grad"])
    title = (
        f"tanh(matmul) chain, {args.depth} layers of {args.width}, batch {args.batch}, float32, "
        "one CPU SGD step"
    )
    print(title, file=sys.stderr, flush=True)
    predicted = predicted_ratios(args.depth, shape, chosen)
    setting = measure.Setting("CPU:0", builds=args.builds, repeats=args.repeats)
    points = measure.sweep(
        "chain", shape, [args.depth], chosen, setting, lambda line: print(line, file=sys.stderr)
    )
    print(title)
    header = ("method", "MiB", "memory ratio", "predicted", "step s", "time ratio")
    print(f"{header[0]:<22}" + "".join(f"{h:>14}" for h in header[1:]))
    for p in points:
        guess = f"{predicted[p.method]:.3f}" if p.method in predicted else ""
        print(
            f"{p.method:<22}{p.activation_mib:>14.1f}{p.memory_ratio:>14.3f}{guess:>14}"
            f"{p.step_s:>14.2f}{p.time_ratio:>13.2f}x"
        )
    with open(args.out / "frontier.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["method", "activation_mib", "memory_ratio", "predicted_ratio",
                         "step_s", "time_ratio"])  # fmt: skip
        for p in points:
            writer.writerow([p.method, p.activation_mib, p.memory_ratio,
                             predicted.get(p.method, ""), p.step_s, p.time_ratio])  # fmt: skip
    try:
        plot(points, args.out / "frontier.png", title)
        print(f"plot: {args.out / 'frontier.png'}")
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[demo]')")
    if not args.targets:
        return 0
    name = repr(msg.MemoryBudget(TARGET_BUDGET))
    target = next(p for p in points if p.method == name)
    checks = {
        f"{name}: memory ratio {target.memory_ratio:.3f} <= {TARGET_MEMORY}":
            target.memory_ratio <= TARGET_MEMORY,
        f"{name}: time ratio {target.time_ratio:.2f}x <= {TARGET_TIME}x":
            target.time_ratio <= TARGET_TIME,
    }  # fmt: skip
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
