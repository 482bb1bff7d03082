"""Graph-building time of checkpointed gradients on large graphs, against plain
`tf.gradients`.

The graph is a residual MLP of B blocks (`a = relu(matmul(h, w) * 0.5 + 0.1)`,
`h = l2_normalize(h + a)`, about 58 ops a block with its gradients). What is timed is what a
user waits for: `get_concrete_function` of a `tf.function` step returning the gradients of
every weight (tracing the forward pass, the strategy's plan, the rewrite and TensorFlow's
gradient calls). Each point runs in a fresh interpreter, so that no point inherits another's
graphs or caches; the points of one size run one after another, plain first. At a batch of 64
rows activations outweigh the weights, so every strategy keeps checkpoints and rewrites.
"""

from __future__ import annotations

import dataclasses

from memory_saving_gradients.cli.suites import isolated
from memory_saving_gradients.cli.suites.page import Page, progress

TITLE = "Build time"
METHODS = ("plain", "memory", "speed", "balanced")


@dataclasses.dataclass(frozen=True)
class Size:
    """Blocks of each graph measured, and the MLP's width and batch."""

    blocks: tuple[int, ...]
    width: int = 32
    batch: int = 64


FULL = Size((250, 1000))
QUICK = Size((10, 20))


def run(page: Page, quick: bool, device: str) -> None:
    import numpy as np

    size = QUICK if quick else FULL
    page.text(
        f"Residual MLP, width {size.width}, batch {size.batch}, float32: seconds to build a "
        "step returning the gradients of every weight (`get_concrete_function`), each point "
        "in a fresh interpreter; in parentheses, over plain's. *growth*: the exponent b of the "
        "least-squares fit seconds ~ ops^b."
    )
    found: dict[str, list[dict[str, float]]] = {method: [] for method in METHODS}
    rows = []
    for blocks in size.blocks:
        for method in METHODS:
            progress(f"build_time: {blocks} blocks, {method}")
            found[method].append(
                isolated.run_alone(
                    "build_time:build_seconds",
                    blocks=blocks,
                    method=method,
                    width=size.width,
                    batch=size.batch,
                    device=device,
                )
            )
        plain = found["plain"][-1]
        rows.append(
            [
                f"{blocks} ({plain['ops'] / 1000:.1f}k)",
                f"{plain['seconds']:.1f}",
                *(_seconds(found[m][-1]["seconds"], plain["seconds"]) for m in METHODS[1:]),
            ]
        )
    if len(size.blocks) > 1:
        growth = []
        for method in METHODS:
            ops = np.log([p["ops"] for p in found[method]])
            seconds = np.log([p["seconds"] for p in found[method]])
            growth.append(f"ops^{np.polyfit(ops, seconds, 1)[0]:.2f}")
        rows.append(["growth", *growth])
    page.table(["blocks (ops)", *(f"'{m}'" if m != "plain" else m for m in METHODS)], rows)


def _seconds(seconds: float, plain: float) -> str:
    return f"{seconds:.1f} ({seconds / plain:.2f}x)"


def build_seconds(blocks: int, method: str, width: int, batch: int, device: str) -> dict:
    """Seconds to trace the step and the number of ops in its graph, in this fresh
    interpreter."""
    import time

    import numpy as np
    import tensorflow as tf

    import memory_saving_gradients as msg
    from memory_saving_gradients._src.models import common

    rng = np.random.default_rng(0)
    with tf.device(device):
        weights = [common.fan_in_normal(rng, (width, width)) for _ in range(blocks)]

    @tf.function
    def step(x: tf.Tensor) -> list[tf.Tensor]:
        h = x
        for w in weights:
            a = tf.nn.relu(tf.matmul(h, w) * 0.5 + 0.1)
            h = tf.math.l2_normalize(h + a, axis=-1)
        loss = tf.reduce_sum(h)
        if method == "plain":
            return tf.gradients(loss, weights)
        return msg.gradients(loss, weights, checkpoints=method)

    start = time.perf_counter()
    concrete = step.get_concrete_function(tf.TensorSpec([batch, width], tf.float32))
    return {
        "seconds": time.perf_counter() - start,
        "ops": len(concrete.graph.get_operations()),
    }
