"""Graph-building time of checkpointed gradients on large graphs, against plain tf.gradients.

The graph is a residual MLP of B blocks (`a = relu(matmul(h, w) * 0.5 + 0.1)`,
`h = l2_normalize(h + a)`, about 58 ops a block with its gradients), the workload of
../shared/anchors.md. What is timed is what a user waits for: `get_concrete_function` of a
`tf.function` step returning the gradients of every weight (tracing the forward pass, the
strategy's plan, the rewrite and TensorFlow's gradient calls). Each point runs in a fresh
interpreter, so no point inherits another's graphs or caches; the points of one size run one
after another, plain first. At the default batch of 64 rows activations outweigh the weights,
so every strategy keeps checkpoints and rewrites (at 8 rows 'balanced' keeps none).

    python benchmarks/build_time.py                              # 250 and 1000 blocks
    python benchmarks/build_time.py --blocks 250 500 1000 2000 --targets
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("plain", "memory", "speed", "balanced")
#: Issue 10: every strategy builds in at most twice plain's time at this size.
TARGET_BLOCKS = 1000
TARGET_RATIO = 2.0


def build_seconds(blocks: int, method: str, width: int, batch: int) -> tuple[float, int]:
    """Seconds to trace the step and the number of ops in its graph (run in this process)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import memory_saving_gradients as msg

    rng = np.random.default_rng(0)
    weights = [
        tf.Variable((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
        for _ in range(blocks)
    ]

    @tf.function
    def step(x):
        h = x
        for w in weights:
            a = tf.nn.relu(tf.matmul(h, w) * 0.5 + 0.1)
            h = tf.math.l2_normalize(h + a, axis=-1)
        loss = tf.reduce_sum(h)
        if method == "plain":
            return tf.gradients(loss, weights)
        return msg.gradients(loss, weights, checkpoints=method)

    spec = tf.TensorSpec([batch, width], tf.float32)
    start = time.perf_counter()
    concrete = step.get_concrete_function(spec)
    seconds = time.perf_counter() - start
    return seconds, len(concrete.graph.get_operations())


def measure_point(blocks: int, method: str, width: int, batch: int) -> dict:
    """`build_seconds` in a fresh interpreter."""
    command = [
        sys.executable, __file__, "--point", str(blocks), method,
        "--width", str(width), "--batch", str(batch),
    ]  # fmt: skip
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def growth_exponent(sizes, seconds) -> float:
    """Exponent b of the least-squares fit seconds ~ ops**b."""
    import numpy as np

    return float(np.polyfit(np.log(sizes), np.log(seconds), 1)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--point", nargs=2, metavar=("BLOCKS", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--targets", action="store_true", help=f"exit 1 unless every method builds within "
        f"{TARGET_RATIO}x plain at {TARGET_BLOCKS} blocks"
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.point:
        seconds, ops = build_seconds(int(args.point[0]), args.point[1], args.width, args.batch)
        print(json.dumps({"seconds": seconds, "ops": ops}))
        return 0

    methods = ["plain", *(m for m in args.methods if m != "plain")]
    print(
        f"Residual MLP, width {args.width}, batch {args.batch}: seconds to build a step "
        "(get_concrete_function) returning the gradients of every weight; each point in a "
        "fresh interpreter"
    )
    header = f"{'blocks':>7} {'ops':>8}" + "".join(f"{m:>16}" for m in methods)
    print(header, flush=True)
    results: dict[str, dict[int, dict]] = {m: {} for m in methods}
    for blocks in args.blocks:
        for method in methods:
            results[method][blocks] = measure_point(blocks, method, args.width, args.batch)
        plain = results["plain"][blocks]["seconds"]
        cells = [f"{plain:>16.1f}"] + [
            f"{results[m][blocks]['seconds']:>8.1f} ({results[m][blocks]['seconds'] / plain:.2f}x)"
            for m in methods[1:]
        ]
        print(f"{blocks:>7} {results['plain'][blocks]['ops']:>8}" + "".join(cells), flush=True)
    exponents = {}
    if len(args.blocks) > 1:
        for method in methods:
            points = [results[method][b] for b in args.blocks]
            exponents[method] = growth_exponent(
                [p["ops"] for p in points], [p["seconds"] for p in points]
            )
        growth = "".join(f"{'ops^' + format(exponents[m], '.2f'):>16}" for m in methods)
        print(f"{'growth':>16}{growth}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args) | {"out": str(args.out)}, "results": results}
    (args.out / "build_time.json").write_text(json.dumps(record | {"exponents": exponents}))
    if not args.targets:
        return 0
    if TARGET_BLOCKS not in args.blocks:
        print(f"FAIL  --targets needs {TARGET_BLOCKS} among --blocks")
        return 1
    plain = results["plain"][TARGET_BLOCKS]["seconds"]
    passed = True
    for method in methods[1:]:
        ratio = results[method][TARGET_BLOCKS]["seconds"] / plain
        ok = ratio <= TARGET_RATIO
        passed &= ok
        verdict = "PASS" if ok else "FAIL"
        print(f"{verdict}  {method}: {ratio:.2f}x plain at {TARGET_BLOCKS} blocks")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
