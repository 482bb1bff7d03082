"""Peak memory and step time of checkpointed gradients on a deep tanh(matmul) chain.

Each training step (inside tf.function) computes the gradients of a chain of N tanh(matmul)
layers and applies them with SGD, either with plain `tf.gradients` or with
`memory_saving_gradients.gradients`. For every depth and method the step is built afresh,
run once to warm up, and run once measured; "activation memory" is the allocator's peak
minus what was resident before the step (weights, input), the median of --memory-repeats
such fresh measurements (TensorFlow's executor orders ready ops differently from run to
run). Step times are taken in turns (plain, checkpointed, plain, ...) in one process, and
reported as the ratio of medians to plain.

    python benchmarks/chain.py                       # quick demo, about two minutes on 2 cores
    python benchmarks/chain.py --batch 2048 --width 1024 --depths 8 16 32 64 128 \\
        --time-depths 32 128 --targets             # the workload of ../shared/anchors.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import interleaved_step_times, peak_memory

tf.get_logger().setLevel("ERROR")  # retracing notices: every step here is traced once

MiB = 2**20
METHODS = ("plain", "memory", "every_sqrt")
#: Targets at the deepest depth, against plain tf.gradients measured in the same run. One level
#: of checkpoints every sqrt(N) layers (issue 2) costs about one extra forward pass; 'memory'
#: nests recomputation where that keeps less (issue 10), about one more forward pass a level.
TARGET_MEMORY_RATIO = 0.19
TARGET_SLOPE = 0.5
TARGET_TIME_RATIO = {"every_sqrt": 1.35, "memory": 1.8}


def training_step(depth: int, batch: int, width: int, method: str):
    """A tf.function SGD step on a fresh chain, and its input."""
    rng = np.random.default_rng(0)
    weights = [
        tf.Variable((rng.standard_normal((width, width)) / math.sqrt(width)).astype(np.float32))
        for _ in range(depth)
    ]
    x = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))
    segment = max(1, round(math.sqrt(depth)))

    @tf.function
    def step(inputs):
        h, activations = inputs, []
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
            activations.append(h)
        loss = tf.reduce_mean(tf.square(h))
        if method == "plain":
            grads = tf.gradients(loss, weights)
        elif method == "every_sqrt":
            every_segment = activations[segment - 1 : -1 : segment]
            grads = msg.gradients(loss, weights, checkpoints=every_segment)
        else:
            grads = msg.gradients(loss, weights, checkpoints=method)
        for w, g in zip(weights, grads, strict=True):
            w.assign_sub(0.01 * g)
        return loss

    return lambda: step(x).numpy()


def activation_mib(depth: int, batch: int, width: int, method: str, repeats: int) -> float:
    """Median over `repeats` freshly built steps of the peak above resident memory, in MiB."""
    peaks = [peak_memory(training_step(depth, batch, width, method)) for _ in range(repeats)]
    return float(np.median(peaks)) / MiB


def slope(depths, values) -> float:
    """Exponent b of the least-squares fit values ~ depth**b."""
    return float(np.polyfit(np.log(depths), np.log(values), 1)[0])


def time_ratios(depth: int, batch: int, width: int, repeats: int) -> dict[str, float]:
    steps = {m: training_step(depth, batch, width, m) for m in METHODS}
    for run in steps.values():
        run()
    times = interleaved_step_times(steps, repeats)
    plain = float(np.median(times["plain"]))
    return {m: float(np.median(t)) / plain for m, t in times.items()} | {"plain_s": plain}


def plot(depths, memory, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for method, values in memory.items():
        axes.loglog(depths, values, "o-", label=method)
    axes.set_xlabel("depth (layers)")
    axes.set_ylabel("activation memory (MiB)")
    axes.set_title("Peak memory of one training step above resident weights")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--time-depths", type=int, nargs="*", default=[32])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per method")
    parser.add_argument("--memory-repeats", type=int, default=3, help="fresh steps per point")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument(
        "--targets", action="store_true", help="exit 1 unless the issue's targets are met"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"tanh(matmul) chain, batch {args.batch}, width {args.width}, float32, TensorFlow "
        f"{tf.__version__}; activation memory in MiB (peak minus resident)"
    )
    print(f"{'depth':>6}" + "".join(f"{m:>12}" for m in METHODS) + f"{'memory/plain':>14}")
    memory = {m: [] for m in METHODS}
    for depth in args.depths:
        for method in METHODS:
            memory[method].append(
                activation_mib(depth, args.batch, args.width, method, args.memory_repeats)
            )
        ratio = memory["memory"][-1] / memory["plain"][-1]
        row = "".join(f"{memory[m][-1]:>12.1f}" for m in METHODS)
        print(f"{depth:>6}{row}{ratio:>14.3f}", flush=True)
    slopes = {m: slope(args.depths, v) for m, v in memory.items()} if len(args.depths) > 1 else {}
    if slopes:
        print(f"{'slope':>6}" + "".join(f"{slopes[m]:>12.2f}" for m in METHODS))
    times = {}
    for depth in args.time_depths:
        times[depth] = time_ratios(depth, args.batch, args.width, args.repeats)
        ratios = ", ".join(f"{m} {times[depth][m]:.2f}x" for m in METHODS if m != "plain")
        print(
            f"step time at depth {depth}: plain {times[depth]['plain_s']:.2f} s; {ratios} "
            f"plain (median of {args.repeats}, interleaved)",
            flush=True,
        )
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "depths": args.depths,
               "memory_mib": memory, "slopes": slopes, "time_ratios": times}  # fmt: skip
    (args.out / "chain.json").write_text(json.dumps(results, indent=2))
    try:
        plot(args.depths, memory, args.out / "chain.png")
        print(f"plot: {args.out / 'chain.png'}")
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[demo]')")
    if not args.targets:
        return 0
    deepest = args.depths[-1]
    checks = {
        f"memory/plain at depth {deepest} <= {TARGET_MEMORY_RATIO}": (
            memory["memory"][-1] / memory["plain"][-1] <= TARGET_MEMORY_RATIO
        ),
        f"'memory' slope <= {TARGET_SLOPE}": slopes.get("memory", 0.0) <= TARGET_SLOPE,
    }
    for depth, ratios in times.items():
        for method, limit in TARGET_TIME_RATIO.items():
            checks[f"{method} step time at depth {depth} <= {limit}x plain"] = (
                ratios[method] <= limit
            )
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
