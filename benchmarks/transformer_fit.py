"""Keras `fit` of transformers: each method's activation peak and step time against plain's.

The models are those of `memory_saving_gradients._src.models.transformers`: the encoder, the
causal decoder, or a keras-hub causal LM family (`--model llama`, ...). Training is
`model.fit` on arrays, as users call it (Keras traces the step with the batch unknown). A
method's activation peak is the allocator's peak during a step above what was resident before
it, the largest of the steps after the first (which traces), in a process of its own (a
process's allocator keeps the blocks earlier, larger steps grew). Step times are medians of
steps timed in turns (`train_on_batch`, the same step), method after method, in one process,
as ratios to plain's. Each method's
predicted peak is its plan's (`model.checkpoint_plan`).

    python benchmarks/transformer_fit.py --model encoder
    python benchmarks/transformer_fit.py --model decoder --methods speed 0.4 memory
    python benchmarks/transformer_fit.py --model llama --methods speed blocks memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import transformers
from memory_saving_gradients.profiling import interleaved_step_times

MiB = 2**20


class StepLog(keras.callbacks.Callback):
    """Each step's activation peak (bytes), the step's results waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.peaks: list[int] = []

    def on_train_batch_begin(self, batch, logs=None):
        tf.config.experimental.reset_memory_stats("CPU:0")
        self._resident = tf.config.experimental.get_memory_info("CPU:0")["current"]

    def on_train_batch_end(self, batch, logs=None):
        for value in keras.tree.flatten(logs or {}):
            if isinstance(value, tf.Tensor):
                value.numpy()
        self.peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - self._resident)


def task_of(args: argparse.Namespace) -> transformers.Task:
    if args.model == "encoder":
        return transformers.encoder(length=args.length or 256, batch=args.batch or 8)
    if args.model == "decoder":
        return transformers.decoder(length=args.length or 512, batch=args.batch or 4)
    return transformers.causal_lm(
        args.model,
        layers_count=args.layers,
        hidden=args.hidden,
        length=args.length or 256,
        batch=args.batch or 4,
        lora_rank=args.lora,
    )


def checkpoints_of(name: str, model: keras.Model):
    """A strategy name, 'blocks' (each transformer block's output), or a budget fraction."""
    if name == "blocks":
        blocks = getattr(getattr(model, "backbone", None), "transformer_layers", None)
        if blocks is not None:
            return msg.keras.layer_outputs(*(block.name for block in blocks))
        return msg.keras.layer_outputs(lambda layer: layer.name.startswith("add"))
    try:
        return msg.MemoryBudget(float(name))
    except ValueError:
        return name


def trained(args: argparse.Namespace, method: str) -> tuple[keras.Model, StepLog, object]:
    """A fresh task's model, enabled with `method` (not for 'plain'), after one epoch."""
    task = task_of(args)
    if method != "plain":
        msg.keras.enable(task.model, checkpoints_of(method, task.model))
    model = task.compile(jit_compile=args.xla)
    log = StepLog()
    model.fit(task.x, task.y, batch_size=task.batch, epochs=1, verbose=0, callbacks=[log])
    return model, log, task


def alone(args: argparse.Namespace, method: str) -> dict:
    model, log, _ = trained(args, method)
    plan = getattr(model, "checkpoint_plan", None)
    return {
        "peak": max(log.peaks[1:]),
        "predicted": None if plan is None else (plan.peak_bytes if plan.pays else None),
        "predicted_plain": None if plan is None else plan.plain_peak_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="encoder")
    parser.add_argument("--methods", nargs="+", default=["speed", "0.4", "memory"])
    parser.add_argument("--length", type=int, help="tokens a sequence (default: per model)")
    parser.add_argument("--batch", type=int, help="sequences a step (default: per model)")
    parser.add_argument("--layers", type=int, default=4, help="keras-hub decoder blocks")
    parser.add_argument("--hidden", type=int, default=128, help="keras-hub hidden size")
    parser.add_argument("--lora", type=int, help="keras-hub: LoRA of this rank")
    parser.add_argument("--xla", action="store_true", help="compile with jit_compile=True")
    parser.add_argument("--repeats", type=int, default=15, help="steps timed per method")
    parser.add_argument("--alone", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.alone is not None:
        print(json.dumps(alone(args, args.alone)))
        return 0
    methods = ["plain", *args.methods]
    found = {}
    for method in methods:
        command = [sys.executable, __file__, *argv, "--alone", method]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        found[method] = json.loads(result.stdout.splitlines()[-1])
    steps = {}
    for method in methods:
        model, _, task = trained(args, method)
        x = keras.tree.map_structure(lambda a, b=task.batch: a[:b], task.x)
        steps[method] = lambda model=model, x=x, y=task.y[: task.batch]: model.train_on_batch(x, y)
    seconds = interleaved_step_times(steps, args.repeats)
    plain_peak = found["plain"]["peak"]
    plain_time = statistics.median(seconds["plain"])
    print(f"Keras fit, {args.model}, {' '.join(argv)}")
    print("| method | activation MiB | / plain | predicted MiB | time / plain |")
    print("| --- | --- | --- | --- | --- |")
    found["plain"]["predicted"] = next(
        (each["predicted_plain"] for each in found.values() if each["predicted_plain"]), None
    )
    for method in methods:
        peak, predicted = found[method]["peak"], found[method]["predicted"]
        shown = "" if predicted is None else f"{predicted / MiB:.1f}"
        print(
            f"| {method} | {peak / MiB:.1f} | {peak / plain_peak:.2f} | {shown} | "
            f"{statistics.median(seconds[method]) / plain_time:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
