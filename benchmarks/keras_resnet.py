"""Peak memory and step time of Keras `fit` on a deep residual CNN, plain and checkpointed.

Plain `fit` is compared with each strategy given (default: 'balanced', then 'memory'). One
training step is `model.train_on_batch`, which runs the same train function as `fit`.
Each measurement builds a fresh model from the same seed, compiles it (SGD with momentum),
runs one warm-up step and one measured step; "activation memory" is the allocator's peak
minus what was resident before the step (weights, optimizer state, the batch), the smallest
of --memory-repeats fresh measurements (TensorFlow's executor orders ready ops differently
from run to run). The checkpointed model is the same model after
`memory_saving_gradients.keras.enable(model, checkpoints=...)`. Step times are taken in turns
(plain, checkpointed, plain, ...) on the last models measured, and compared as medians.

    python benchmarks/keras_resnet.py --targets     # issue 3's workload: 9 minutes on 2 cores,
                                                    # mostly tracing 9 fresh models
    python benchmarks/keras_resnet.py --blocks 8 --memory-repeats 1    # a quick look
    python benchmarks/keras_resnet.py --dtype mixed_float16    # Keras's mixed precision policy
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import interleaved_step_times, peak_memory

tf.get_logger().setLevel("ERROR")  # retracing notices: each fresh model's step is traced once

MiB = 2**20
#: Targets of issue 3, against plain `fit` measured in the same run.
TARGET_MEMORY_FACTOR = 2.5
TARGET_TIME_RATIO = 1.35


def residual_cnn(blocks: int, channels: int, size: int, classes: int = 10) -> keras.Model:
    """ResNet-style basic blocks (conv, batch norm, ReLU, conv, batch norm, add, ReLU)."""
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(inputs)
    for _ in range(blocks):
        r = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(h)
        r = keras.layers.ReLU()(keras.layers.BatchNormalization()(r))
        r = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(r)
        r = keras.layers.BatchNormalization(gamma_initializer="zeros")(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(classes)(h))


def build_model(args: argparse.Namespace) -> keras.Model:
    """The residual CNN, or a `keras.applications` model (weights=None) named by --model."""
    if args.model == "residual":
        return residual_cnn(args.blocks, args.channels, args.size)
    application = getattr(keras.applications, args.model)
    return application(weights=None, input_shape=(args.size, args.size, 3), classes=10)


def train_step(args: argparse.Namespace, checkpoints: object | None):
    """One `train_on_batch` of a fresh model, plain when `checkpoints` is None."""
    keras.utils.set_random_seed(0)
    model = build_model(args)
    if checkpoints is not None:
        msg.keras.enable(model, checkpoints=checkpoints, measure=args.measure)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((args.batch, args.size, args.size, 3)).astype("f4"))
    y = tf.constant(rng.integers(0, 10, args.batch))
    return lambda: model.train_on_batch(x, y)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="residual", help="'residual', or a keras.applications name"
    )
    parser.add_argument("--blocks", type=int, default=56)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=["float32", "mixed_float16"], default="float32")
    parser.add_argument(
        "--checkpoints",
        nargs="+",
        default=["balanced", "memory"],
        help="strategies to compare with plain; --targets judges the first",
    )
    parser.add_argument(
        "--budgets", type=float, nargs="*", default=[], help="MemoryBudget fractions to compare"
    )
    parser.add_argument(
        "--measure", action="store_true", help="plan from the first step, measured"
    )
    parser.add_argument("--memory-repeats", type=int, default=3, help="fresh models per method")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per method")
    parser.add_argument(
        "--targets", action="store_true", help="exit 1 unless the first strategy meets the targets"
    )
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy(args.dtype)  # mixed: compile loss-scales
    methods: dict[str, object] = {"plain": None, **{name: name for name in args.checkpoints}}
    methods.update({f"budget {b:g}": msg.MemoryBudget(b) for b in args.budgets})
    model = (
        f"residual CNN of {args.blocks} blocks, {args.channels} channels"
        if args.model == "residual"
        else f"keras.applications.{args.model}"
    )
    print(
        f"Keras {keras.__version__} fit step, TensorFlow {tf.__version__}: {model}, "
        f"{args.size}x{args.size} images, batch {args.batch}, {args.dtype}",
        flush=True,
    )
    peaks: dict[str, list[float]] = {name: [] for name in methods}
    steps = {}
    for _ in range(args.memory_repeats):
        for name, checkpoints in methods.items():
            steps[name] = train_step(args, checkpoints)
            peaks[name].append(peak_memory(steps[name]) / MiB)
    times = interleaved_step_times(steps, args.repeats)
    best = {name: min(values) for name, values in peaks.items()}
    median = {name: float(np.median(values)) for name, values in times.items()}

    print(
        f"{'method':>12}{'activation MiB':>16}{'step s':>10}{'less memory':>13}"
        f"{'time ratio':>12}   fresh models' peaks, MiB"
    )
    for name in methods:
        runs = ", ".join(f"{peak:.0f}" for peak in peaks[name])
        less, ratio = best["plain"] / best[name], median[name] / median["plain"]
        print(
            f"{name:>12}{best[name]:>16.1f}{median[name]:>10.3f}{less:>12.2f}x{ratio:>11.2f}x"
            f"   {runs}"
        )
    print(
        f"(activation memory: best of {args.memory_repeats} fresh models; step time: median of "
        f"{args.repeats}, interleaved)"
    )
    met = {}
    for name in args.checkpoints:
        memory_factor = best["plain"] / best[name]
        time_ratio = median[name] / median["plain"]
        checks = {
            f"{name}: activation memory >= {TARGET_MEMORY_FACTOR}x less than plain":
                memory_factor >= TARGET_MEMORY_FACTOR,
            f"{name}: step time <= {TARGET_TIME_RATIO}x plain": time_ratio <= TARGET_TIME_RATIO,
        }  # fmt: skip
        for check, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {check}")
        met[name] = all(checks.values())
    return 0 if met[args.checkpoints[0]] or not args.targets else 1


if __name__ == "__main__":
    sys.exit(main())
