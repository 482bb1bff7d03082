"""How far a step's peak memory can be counted on, on the model zoo (`_src/models/zoo.py`),
whether 'memory' needs the least of every strategy and budget, and what of a peak is the
allocator's rounding.

For each model, plain `tf.gradients`, the strategies and two budgets each compute the
gradients of the model's training loss in a `tf.function` (returned, so weight gradients live
to the end of the step, as the planner is told), with two inter-op threads: the executor then
runs ready ops in an order that varies from step to step. Each configuration is traced once,
warmed up and measured on several steps (the allocator's peak above resident memory), best
and worst; step times are the medians of each turn's ratio to plain's, the steps of every
configuration taken in turns (`msg.profiling.step_time_ratios`).
Each model runs in a fresh interpreter (the thread count must be set before TensorFlow's
runtime starts) whose allocator was first grown, so that each request is cut from one large
free block rather than from whatever regions earlier models left.

One more step of each configuration runs under the profiler (`trace.profiled`): the largest
sum of bytes its live tensors requested moves only with the executor's order; the rest of
the allocator's peak is its rounding (a free block of less than twice a request is handed
out whole).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memory_saving_gradients.cli import runtime
from memory_saving_gradients.cli.suites import isolated
from memory_saving_gradients.cli.suites.page import Page, number, progress

TITLE = "Peaks move between steps"
MIB = 2**20
#: MiB of the free block each model's process makes first.
GROWN_MIB = 2048
#: Inter-op threads: with two the executor's order varies, as in training.
THREADS = 2
#: The configurations compared, plain first (None: `tf.gradients`; a float: a budget).
CONFIGS: dict[str, str | float | None] = {
    "plain": None,
    "'speed'": "speed",
    "'memory'": "memory",
    "'balanced'": "balanced",
    "MemoryBudget(0.25)": 0.25,
    "MemoryBudget(0.5)": 0.5,
}
#: Ops listed as alive at the largest requested peak of 'memory' on the first model.
TOP_OPS = 8


@dataclasses.dataclass(frozen=True)
class Size:
    """The zoo models, their `zoo.Scale` (as keyword arguments), measured steps per
    configuration and turns timed (`step_time_ratios`)."""

    models: tuple[str, ...]
    scale: dict[str, int]
    steps: int
    repeats: int


FULL = Size(
    ("resnet", "densenet", "mobilenet_v2", "inception", "unet", "transformer", "mlp",
     "function_layers", "custom_gradient_cnn"),
    {"size": 96, "batch": 8, "length": 256, "dim": 64, "rows": 16384, "width": 32},
    5,
    3,
)  # fmt: skip
QUICK = Size(("mlp",), {"rows": 8192, "width": 32}, 3, 2)


def zoo_at(scale: dict[str, int]) -> str:
    """How a page names the zoo's scale: the `zoo.Scale` call that builds it."""
    return f"`zoo.Scale({', '.join(f'{k}={v}' for k, v in scale.items())})`"


def run(page: Page, quick: bool, device: str) -> None:
    size = QUICK if quick else FULL
    page.text(
        f"The zoo at {zoo_at(size.scale)}, "
        f"float32, {THREADS} inter-op threads, on {device}; each model in a process of its own "
        f"whose allocator was first grown by {GROWN_MIB} MiB. *best*, *worst*: the allocator's "
        f"peak above resident memory over {size.steps} steps; *time*: the median of "
        f"{size.repeats} turns' ratios of a step's time to plain's in the same turn; "
        "*requested*: the largest sum of "
        "bytes live tensors requested in one profiled step; *rounding*: the allocator's peak "
        "of that step less what its live tensors requested then."
    )
    rows, alive = [], None
    for name in size.models:
        progress(f"determinism: {name}")
        found = isolated.run_alone(
            "determinism:measure_model",
            name=name,
            scale=size.scale,
            steps=size.steps,
            repeats=size.repeats,
            device=device,
        )
        plain = max(found["plain"]["peaks"])
        least = min(max(f["peaks"]) for f in found.values())
        for config, f in found.items():
            best, worst = min(f["peaks"]), max(f["peaks"])
            predicted = number(f.get("predicted"), "{:.1f}")
            if f.get("levels", 1) > 1:
                predicted += f" ({f['levels']} levels)"
            rows.append(
                [
                    name, config, f"{best:.1f}", f"{worst:.1f}", f"{worst / best:.2f}",
                    f"{worst / plain:.2f}", f"{worst / least:.2f}", f"{f['time_ratio']:.2f}x",
                    predicted, f"{f['requested']:.1f}", f"{f['rounding']:.1f}",
                ]
            )  # fmt: skip
        alive = alive or (name, found["'memory'"]["alive"])
    page.table(
        [
            "model", "configuration", "best MiB", "worst MiB", "worst / best", "worst / plain",
            "worst / least worst", "time / plain", "predicted MiB", "requested MiB",
            "rounding MiB",
        ],
        rows,
    )  # fmt: skip
    if alive:
        name, ops = alive
        page.text(
            f"Alive at the largest requested peak of `'memory'` on {name}, by the op that "
            "allocated it:"
        )
        page.table(["op", "requested MiB"], [[f"`{op}`", f"{mib:.2f}"] for op, mib in ops])


def measure_model(
    name: str,
    scale: dict[str, int],
    steps: int,
    repeats: int,
    device: str,
    dtype: str = "float32",
    configs: list[str] | None = None,
    profile: bool = True,
) -> dict[str, dict[str, Any]]:
    """Each configuration of `configs` (default: every one; plain first) of zoo model
    `name` under the Keras dtype policy `dtype`, profiled once each where `profile`, in a
    fresh interpreter."""
    import keras
    import tensorflow as tf

    import memory_saving_gradients as msg
    from memory_saving_gradients._src.models import zoo
    from memory_saving_gradients.cli.suites import trace
    from memory_saving_gradients.profiling import peak_memory, step_time_ratios

    tf.config.threading.set_inter_op_parallelism_threads(THREADS)
    keras.mixed_precision.set_global_policy(dtype)
    runtime.grow_allocator(GROWN_MIB, device)
    model = zoo.ALL[name](zoo.Scale(**scale))
    runs, found = {}, {}
    for config in configs or CONFIGS:
        named = CONFIGS[config]
        checkpoints = msg.MemoryBudget(named) if isinstance(named, float) else named
        plan: dict[str, Any] = {}
        run = _gradient_step(model, checkpoints, plan)
        run()
        runs[config] = run
        found[config] = {
            "peaks": [peak_memory(run, device, warmup=0) / MIB for _ in range(steps)],
            **plan,
        }
        if not profile:
            continue
        traced = trace.profiled(run, device)
        found[config]["requested"] = traced.requested_peak / MIB
        found[config]["rounding"] = (traced.peak - traced.requested_at_peak) / MIB
        if config == "'memory'":
            top = trace.by_op(traced.live_at_requested_peak).most_common(TOP_OPS)
            found[config]["alive"] = [(op, size / MIB) for op, size in top]
    for config, ratio in step_time_ratios(runs, "plain", repeats).items():
        found[config]["time_ratio"] = ratio.median
    return found


def _gradient_step(model: Any, checkpoints: Any, plan: dict[str, Any]) -> Any:
    """A fresh tf.function returning the gradients of the model's loss; `plan` receives the
    plan's predicted peak (MiB) and its levels when it is traced."""
    import tensorflow as tf

    import memory_saving_gradients as msg

    @tf.function
    def step(*inputs: Any) -> list[tf.Tensor]:
        loss, _ = model.forward(*inputs)
        if checkpoints is None:
            grads = tf.gradients(loss, model.trainable)
        else:
            chosen = msg.plan(loss, model.trainable, checkpoints=checkpoints, gradients_held=True)
            plan.update(predicted=chosen.peak_bytes / MIB, levels=len(chosen.levels))
            grads = msg.gradients(loss, model.trainable, checkpoints=chosen, gradients_held=True)
        return tf.nest.flatten(grads, expand_composites=True)

    return lambda: [t.numpy() for t in step(*model.inputs)]
