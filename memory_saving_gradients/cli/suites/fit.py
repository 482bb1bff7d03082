"""Keras `fit`: each method's activation peak, its predicted ratio to plain's and its step
time, on a deep residual CNN, a transformer encoder (with attention dropout and without), a
causal decoder and a keras-hub Llama (`_src/models/transformers.py`).

One training step is `train_on_batch`, the train function `fit` runs (SGD with momentum;
AdamW for the keras-hub model, whose decoder blocks per-block checkpoints keep).
A method's peak is the largest of a few steps after the first (which traces and plans),
above what was resident before each (weights, optimizer state, the batch), in a process of
its own, as a user training one model has it: TensorFlow's allocator keeps the blocks a
process's earlier steps grew and hands a request a free block of up to twice its size
whole, so a step run after a larger one (plain) can read more than it needs. The "shared"
column reads the same peak in one process after plain and the methods before it, where
every step is also timed in turns with plain's: the median of the turns' ratios to plain, and
their middle half, which shows how far the machine moved them. The predicted
ratio is the plan's (`model.checkpoint_plan`): `step_peak_bytes / plain_peak_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from memory_saving_gradients.cli.suites import isolated, plots
from memory_saving_gradients.cli.suites.page import Page, number, progress

TITLE = "Keras fit"
MIB = 2**20
#: Methods besides plain: strategies by name, budgets by their fraction; "blocks" keeps each
#: keras-hub decoder block's output (`msg.keras.layer_outputs`).
METHODS = ("speed", "balanced", "0.4", "memory")
HUB_METHODS = (*METHODS, "blocks")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model `fit` trains: 'residual' (`residual_cnn`), 'encoder' (`transformers.encoder`),
    'decoder' (`transformers.decoder`) or a keras-hub family (`transformers.causal_lm`), its
    depth (blocks), width (channels or model dimension), input size (image side or tokens)
    and batch; the encoder's attention dropout (without it, Keras scales the logits after the
    query-key product, as `keras.ops.dot_product_attention` does)."""

    model: str
    depth: int
    width: int
    size: int
    batch: int
    dropout: float = 0.1

    @property
    def slug(self) -> str:
        """What names its plot: the model, and whether the encoder drops attention out."""
        if self.model == "encoder" and not self.dropout:
            return "encoder-no-dropout"
        return self.model

    def describe(self) -> str:
        if self.model == "residual":
            return (
                f"residual CNN of {self.depth} blocks, {self.width} channels, "
                f"{self.size}x{self.size} images, batch {self.batch}"
            )
        name = {"encoder": "transformer encoder", "decoder": "causal decoder"}.get(
            self.model, f"keras-hub {self.model} causal LM"
        )
        described = (
            f"{name} of {self.depth} blocks, width {self.width}, "
            f"{self.size} tokens, batch {self.batch}"
        )
        if self.model == "encoder" and not self.dropout:
            described += ", no attention dropout"
        return described

    @property
    def methods(self) -> tuple[str, ...]:
        return METHODS if self.model in ("residual", "encoder", "decoder") else HUB_METHODS


#: The residual CNN, and the transformers issue 41 sets targets on.
FULL = (
    Workload("residual", 20, 16, 32, 8),
    Workload("encoder", 8, 64, 256, 8),
    Workload("encoder", 8, 64, 256, 8, dropout=0.0),
    Workload("decoder", 6, 256, 512, 4),
    Workload("llama", 4, 128, 256, 4),
)
QUICK = (Workload("residual", 4, 8, 32, 8),)


def run(page: Page, quick: bool, device: str) -> None:
    workloads = QUICK if quick else FULL
    steps, turns = (2, 2) if quick else (3, 15)
    page.text(
        f"`train_on_batch`, float32, on {device}. *MiB*: the largest activation peak of "
        f"{steps} steps after the first, in a process of its own; *shared*: the same in one "
        "process after the methods before it; *predicted*: the plan's peak over plain "
        "backprop's as simulated (which counts the attention matrix per block that "
        "TensorFlow's own optimizers make plain backprop hold where attention scales its "
        "logits after the query-key product: docs/internals/memory-model.md); *time*: the "
        f"median over {turns} turns of a step's time over plain's in the same turn, and "
        "*middle half* the quartiles of those ratios."
    )
    for workload in workloads:
        progress(f"fit: {workload.describe()}")
        page.text(f"## {workload.describe()}")
        methods = ("speed", "memory") if quick else workload.methods
        rows = measure(workload, ["plain", *methods], steps, turns, device)
        plain = rows[0]
        page.table(
            [
                "method",
                "MiB",
                "/ plain",
                "predicted",
                "shared / plain",
                "time / plain",
                "middle half",
            ],
            [
                [
                    _label(row["method"]),
                    f"{row['peak']:.1f}",
                    f"{row['peak'] / plain['peak']:.2f}",
                    number(row["predicted"]),
                    f"{row['shared'] / plain['shared']:.2f}",
                    f"{row['time'].median:.2f}x",
                    f"{row['time'].lower_quartile:.2f}-{row['time'].upper_quartile:.2f}x",
                ]
                for row in rows
            ],
        )
        points = [(_label(r["method"]), r["peak"] / plain["peak"], r["time"].median) for r in rows]
        title = f"Keras fit, {workload.describe()}"
        page.plot(
            workload.slug,
            functools.partial(plots.frontier, points, title=title, joined="MemoryBudget"),
            f"step time against activation memory, {workload.slug}",
        )


def measure(
    workload: Workload, methods: list[str], steps: int, turns: int, device: str
) -> list[dict[str, Any]]:
    """Each method's peak alone (a fresh interpreter each), shared and timed here, in turns
    with the first method's."""
    from memory_saving_gradients.profiling import step_time_ratios

    fields = dataclasses.asdict(workload)
    alone = {
        method: isolated.run_alone(
            "fit:peak_alone", workload=fields, method=method, steps=steps, device=device
        )
        for method in methods
    }
    runs, shared = {}, {}
    for method in methods:
        runs[method] = _train_step(workload, method)[1]
        shared[method] = _worst_peak(runs[method], steps, device)
    times = step_time_ratios(runs, methods[0], turns)
    return [
        {
            "method": method,
            "shared": shared[method],
            "time": times[method],
            **alone[method],
        }
        for method in methods
    ]


def peak_alone(workload: dict[str, Any], method: str, steps: int, device: str) -> dict:
    """The worst peak of `method`'s steps in this fresh interpreter, and its prediction."""
    model, run = _train_step(Workload(**workload), method)
    peak = _worst_peak(run, steps, device)
    plan = getattr(model, "checkpoint_plan", None)
    predicted = plan.step_peak_bytes / plan.plain_peak_bytes if plan is not None else None
    return {"peak": peak, "predicted": predicted}


def _label(method: str) -> str:
    if method == "plain":
        return method
    if method == "blocks":
        return "per-block checkpoints"
    try:
        return f"MemoryBudget({float(method)})"
    except ValueError:
        return f"'{method}'"


def _checkpoints(method: str) -> Any:
    import memory_saving_gradients as msg

    try:
        return msg.MemoryBudget(float(method))
    except ValueError:
        return method


def _train_step(workload: Workload, method: str) -> tuple[Any, Any]:
    """A fresh model, enabled with `method` (not for 'plain') and compiled, and one
    `train_on_batch` of it."""
    import memory_saving_gradients as msg
    from memory_saving_gradients._src.models import transformers

    sizes = {"length": workload.size, "batch": workload.batch, "batches": 1}
    if workload.model == "residual":
        task = residual_cnn(workload.depth, workload.width, workload.size, workload.batch)
    elif workload.model == "encoder":
        task = transformers.encoder(
            blocks=workload.depth, width=workload.width, dropout=workload.dropout, **sizes
        )
    elif workload.model == "decoder":
        task = transformers.decoder(blocks=workload.depth, width=workload.width, **sizes)
    else:
        task = transformers.causal_lm(
            workload.model, layers_count=workload.depth, hidden=workload.width, **sizes
        )
    if method == "blocks":
        blocks = transformers.decoder_blocks(task.model)
        msg.keras.enable(task.model, checkpoints=msg.keras.layer_outputs(*blocks))
    elif method != "plain":
        msg.keras.enable(task.model, checkpoints=_checkpoints(method))
    model = task.compile()
    return model, lambda: model.train_on_batch(task.x, task.y)


def _worst_peak(run: Any, steps: int, device: str) -> float:
    """The largest activation peak, in MiB, of `steps` steps after one that traces."""
    from memory_saving_gradients.profiling import peak_memory

    run()
    return max(peak_memory(run, device, warmup=0) for _ in range(steps)) / MIB


def residual_cnn(blocks: int, channels: int, size: int, batch: int, classes: int = 10) -> Any:
    """A `transformers.Task` of ResNet-style basic blocks (conv, batch norm, ReLU, conv,
    batch norm, add, ReLU) classifying random images; each residual branch's last batch
    norm starts at zero, as in ResNet training."""
    import keras

    from memory_saving_gradients._src.models import common, transformers

    layers = keras.layers
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, 3))
    h = layers.Conv2D(channels, 3, padding="same", activation="relu")(inputs)
    for _ in range(blocks):
        r = layers.Conv2D(channels, 3, padding="same", use_bias=False)(h)
        r = layers.ReLU()(layers.BatchNormalization()(r))
        r = layers.Conv2D(channels, 3, padding="same", use_bias=False)(r)
        r = layers.BatchNormalization(gamma_initializer="zeros")(r)
        h = layers.ReLU()(layers.Add()([h, r]))
    h = layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, layers.Dense(classes)(h))
    return transformers.Task(
        model,
        common.images(1, batch, size),
        common.labels(batch, classes),
        batch,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    )
