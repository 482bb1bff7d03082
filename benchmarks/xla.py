"""Peak memory and step time of checkpointed gradients under XLA (`jit_compile=True`).

Two workloads, each plain and checkpointed ('memory'), each with and without XLA:

- chain: a `tf.function` SGD step on N tanh(matmul) layers, gradients by `tf.gradients` or
  `memory_saving_gradients.gradients` (default: 32 layers, width 512, batch 1024);
- keras: `train_on_batch` (the train function `fit` runs) of a Sequential of N tanh Dense
  layers and a Dense(1) head, compiled with `jit_compile`, plain or after
  `memory_saving_gradients.keras.enable` (default: 24 layers of 512, batch 1024, SGD).

Activation memory is the allocator's peak minus what was resident before the step
(`memory_saving_gradients.profiling.peak_memory`). TensorFlow's CPU allocator counts a block
it does not split whole: a 67 MiB request served from a fresh 128 MiB region reads 128 MiB,
so a peak depends on what ran before. Each point is measured in two fresh processes: as the
allocator starts ("fresh process", what a training script sees), and once a free block far
larger than the step was made, from which each request is cut to its size ("grown
allocator": what the step needs). For steps compiled by XLA the size of XLA's own buffers
(its buffer assignment, read from an XLA dump) is printed too. Ratios are against plain
measured in the same run with the same XLA setting. Step times are medians of interleaved
runs (plain XLA, checkpointed XLA, plain XLA, ...) in this process.

    python benchmarks/xla.py --targets       # the issue's workloads, about 3 minutes on 2 cores
    python benchmarks/xla.py --chain-step return   # the chain step returns its gradients
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import interleaved_step_times, peak_memory

tf.get_logger().setLevel("ERROR")  # retracing notices: every step here is traced once

MiB = 2**20
#: Targets of issue 11, against plain XLA measured in the same run.
TARGET_CHAIN_RATIO = 0.35
TARGET_KERAS_RATIO = 0.5
TARGET_TIME_RATIO = 1.4
#: MiB of the free block made before the measured step (see the module docstring).
GROWN_MIB = 512


def chain_step(args: argparse.Namespace, checkpoints: str | None, jit: bool):
    """A fresh chain step; it applies SGD (or, with --chain-step return, returns the
    gradients)."""
    rng = np.random.default_rng(0)
    scale = 1 / math.sqrt(args.chain_width)
    weights = [
        tf.Variable((rng.standard_normal((args.chain_width,) * 2) * scale).astype("f4"))
        for _ in range(args.chain_depth)
    ]
    x = tf.constant(rng.standard_normal((args.batch, args.chain_width)).astype("f4"))

    @tf.function(jit_compile=jit)
    def step(x):
        h = x
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(h))
        if checkpoints is None:
            grads = tf.gradients(loss, weights)
        else:
            grads = msg.gradients(loss, weights, checkpoints=checkpoints)
        if args.chain_step == "return":
            return grads
        for w, g in zip(weights, grads, strict=True):
            w.assign_sub(0.01 * g)
        return loss

    return lambda: tf.nest.map_structure(lambda t: t.numpy(), step(x))


def keras_step(args: argparse.Namespace, checkpoints: str | None, jit: bool):
    """`train_on_batch` of a fresh Sequential of tanh Dense layers."""
    keras.utils.set_random_seed(0)
    width = args.keras_width
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="tanh") for _ in range(args.keras_depth)]
        + [keras.layers.Dense(1)]
    )
    if checkpoints is not None:
        msg.keras.enable(model, checkpoints=checkpoints)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((args.batch, width)).astype("f4"))
    y = tf.constant(rng.standard_normal((args.batch, 1)).astype("f4"))

    def run():
        model.train_on_batch(x, y)

    run.model = model
    return run


WORKLOADS = {"chain": chain_step, "keras": keras_step}


def xla_buffer_mib(dump: Path) -> float:
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
    return max(sizes) / MiB


def measure_point(args: argparse.Namespace) -> None:
    """Measure one point (--point workload:xla:method:allocator) in this fresh process, with
    the allocator as it starts ("fresh") or grown first ("grown"); print it."""
    workload, jit, method, allocator = args.point.split(":")
    if allocator == "grown":
        grow = tf.zeros([GROWN_MIB * MiB // 4])  # a free block each request is cut from
        del grow
    checkpoints = None if method == "plain" else method
    run = WORKLOADS[workload](args, checkpoints, jit == "on")
    if workload == "keras":
        assert run.model.jit_compile == (jit == "on"), "the Keras model changed jit_compile"
    peak = peak_memory(run) / MiB
    dump = os.environ.get("XLA_FLAGS", "").partition("--xla_dump_to=")[2].split(" ")[0]
    xla = xla_buffer_mib(Path(dump)) if dump and jit == "on" else None
    print("POINT " + json.dumps({"peak": peak, "xla": xla}), flush=True)


def fresh_process_point(argv: list[str], point: str) -> dict:
    """`measure_point` in a fresh interpreter, with XLA dumping its buffer assignment."""
    with tempfile.TemporaryDirectory() as dump:
        environment = {
            **os.environ,
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
            "--xla_dump_hlo_as_text".strip(),
        }
        result = subprocess.run(
            [sys.executable, __file__, *argv, "--point", point],
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
    lines = [line for line in result.stdout.splitlines() if line.startswith("POINT ")]
    if result.returncode or not lines:
        raise RuntimeError(f"point {point} failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("POINT ") :])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--checkpoints", default="memory")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chain-depth", type=int, default=32)
    parser.add_argument("--chain-width", type=int, default=512)
    parser.add_argument("--chain-step", choices=["sgd", "return"], default="sgd")
    parser.add_argument("--keras-depth", type=int, default=24)
    parser.add_argument("--keras-width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per method")
    parser.add_argument(
        "--targets", action="store_true", help="exit 1 unless the issue's targets are met"
    )
    parser.add_argument("--point", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point:
        measure_point(args)
        return 0
    name = args.checkpoints
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, CPU; batch {args.batch}, "
        f"float32; chain: {args.chain_depth} tanh(matmul) of {args.chain_width} "
        f"({args.chain_step} step); keras: {args.keras_depth} tanh Dense of {args.keras_width}"
    )
    print(f"{'':>14}{'fresh process MiB':>24}{'grown allocator MiB':>26}{'XLA buffers MiB':>24}")
    print(
        f"{'workload':>9}{'XLA':>5}{'plain':>9}{name:>9}{'ratio':>6}{'plain':>11}{name:>9}"
        f"{'ratio':>6}{'plain':>11}{name:>7}{'ratio':>6}{'time ratio':>12}"
    )
    checks = {}
    for workload in args.workloads:
        found = {}
        for jit in ("off", "on"):
            for method in ("plain", name):
                point = {
                    allocator: fresh_process_point(argv, f"{workload}:{jit}:{method}:{allocator}")
                    for allocator in ("fresh", "grown")
                }
                found[jit, method] = {
                    "fresh": point["fresh"]["peak"],
                    "peak": point["grown"]["peak"],
                    "xla": point["grown"]["xla"],
                }
        steps = {m: WORKLOADS[workload](args, None if m == "plain" else m, True)
                 for m in ("plain", name)}  # fmt: skip
        for run in steps.values():
            run()
        times = interleaved_step_times(steps, args.repeats)
        time_ratio = float(np.median(times[name]) / np.median(times["plain"]))
        for jit in ("off", "on"):
            plain, checkpointed = found[jit, "plain"], found[jit, name]
            row = f"{workload:>9}{jit:>5}"
            for key, width in (("fresh", 9), ("peak", 11)):
                row += f"{plain[key]:>{width}.1f}{checkpointed[key]:>9.1f}"
                row += f"{checkpointed[key] / plain[key]:>6.2f}"
            if jit == "on":
                row += f"{plain['xla']:>11.1f}{checkpointed['xla']:>7.1f}"
                row += f"{checkpointed['xla'] / plain['xla']:>6.2f}{time_ratio:>11.2f}x"
            print(row, flush=True)
        print(
            f"{'':>9} XLA on / off (grown allocator): plain "
            f"{found['on', 'plain']['peak'] / found['off', 'plain']['peak']:.2f}x, {name} "
            f"{found['on', name]['peak'] / found['off', name]['peak']:.2f}x; plain XLA step "
            f"{np.median(times['plain']):.3f} s",
            flush=True,
        )
        target = TARGET_CHAIN_RATIO if workload == "chain" else TARGET_KERAS_RATIO
        on = (found["on", name], found["on", "plain"])
        checks[f"{workload}: {name} peak <= {target} of plain XLA (grown allocator)"] = (
            on[0]["peak"] / on[1]["peak"] <= target
        )
        checks[f"{workload}: {name} peak <= {target} of plain XLA (fresh process)"] = (
            on[0]["fresh"] / on[1]["fresh"] <= target
        )
        checks[f"{workload}: {name} step time <= {TARGET_TIME_RATIO}x plain XLA"] = (
            time_ratio <= TARGET_TIME_RATIO
        )
    print(
        "(allocator peak above resident memory, one fresh process per point; XLA buffers: "
        "temporary buffer plus outputs aliasing no input; step time: median of "
        f"{args.repeats}, interleaved)"
    )
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    return 0 if all(checks.values()) or not args.targets else 1


if __name__ == "__main__":
    sys.exit(main())
