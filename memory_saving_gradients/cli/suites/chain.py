"""Deep tanh(matmul) chains: activation memory and step time against depth, and at one depth
the frontier of budgets between plain's memory and 'memory''s.

Both parts run `cli.measure.sweep` (each step on a fresh build, the smallest peak of fresh
builds above resident memory, times interleaved in turns against plain's in the same turns).
One level of checkpoints every sqrt(depth) layers is `tf.recompute_grad` around groups of
about sqrt(depth) layers (`models.command._in_groups`): it costs about one extra forward pass.
'memory' nests recomputation where that predicts a smaller peak, so its memory grows about as
log(depth) rather than sqrt(depth), at about one more forward pass a level; a budget between
one level's least and plain's peak recomputes less. The frontier sets each plan's predicted
ratio (`Plan.peak_bytes / Plan.plain_peak_bytes`) beside the one measured.
"""

from __future__ import annotations

import dataclasses

from memory_saving_gradients._src.models import command as models
from memory_saving_gradients.cli import measure, report
from memory_saving_gradients.cli.suites import plots
from memory_saving_gradients.cli.suites.page import Page, number, progress

TITLE = "Deep chains: memory and time against depth, and the budgets' frontier"


@dataclasses.dataclass(frozen=True)
class Size:
    """What the suite measures: the depths of the sweep, the frontier's depth and budgets,
    the chain's batch and width, and `measure.Setting`'s builds and repeats."""

    depths: tuple[int, ...]
    frontier_depth: int
    budgets: tuple[float, ...]
    batch: int
    width: int
    builds: int
    repeats: int


FULL = Size((8, 16, 32, 64), 64, (0.5, 0.33, 0.25, 0.18, 0.14, 0.1), 512, 512, 2, 3)
QUICK = Size((4, 8), 8, (0.5, 0.25), 512, 128, 1, 2)


def run(page: Page, quick: bool, device: str) -> None:
    size = QUICK if quick else FULL
    shape = models.Shape(size.batch, size.width, size=0)
    setting = measure.Setting(device, size.builds, size.repeats)
    described = (
        f"tanh(matmul) chain of width {size.width}, batch {size.batch}, float32, an SGD step "
        f"in a `tf.function` on {device}"
    )
    page.text(
        f"{described}. Activation memory: the allocator's peak above resident memory, the "
        f"smallest of {size.builds} fresh builds; step time: the median of {size.repeats} "
        "steps taken in turns with plain's; ratios to plain at the same depth. "
        "`tf.recompute_grad` wraps groups of about sqrt(depth) layers: one level of "
        "checkpoints every sqrt(depth) layers."
    )
    page.text("## Memory against depth")
    chosen = measure.methods(["memory", "balanced"], [], ["recompute_grad"])
    points = measure.sweep("chain", shape, size.depths, chosen, setting, progress)
    _sweep_table(page, points)
    plain_text = described.replace("`", "")
    page.plot("depth", lambda path: report.plot(points, path, plain_text), "memory and time")
    page.text(f"## Budgets at depth {size.frontier_depth}")
    chosen = measure.methods(["memory", "balanced"], size.budgets, ["recompute_grad"])
    predicted = predicted_ratios(size.frontier_depth, shape, chosen)
    points = measure.sweep("chain", shape, [size.frontier_depth], chosen, setting, progress)
    page.table(
        ["method", "activation MiB", "memory / plain", "predicted", "step s", "time / plain"],
        [
            [
                p.method,
                f"{p.activation_mib:.1f}",
                f"{p.memory_ratio:.3f}",
                number(predicted.get(p.method), "{:.3f}"),
                f"{p.step_s:.3f}",
                f"{p.time_ratio:.2f}x",
            ]
            for p in points
        ],
    )
    frontier = [(p.method, p.memory_ratio, p.time_ratio) for p in points]
    title = f"{plain_text}, depth {size.frontier_depth}"
    page.plot(
        "frontier",
        lambda path: plots.frontier(frontier, path, title, joined="MemoryBudget"),
        "step time against activation memory",
    )


def _sweep_table(page: Page, points: list[measure.Point]) -> None:
    """One row per depth: plain's MiB, then each method's memory ratio (time ratio)."""
    methods = list(dict.fromkeys(p.method for p in points if p.method != measure.PLAIN.name))
    rows = []
    for depth in dict.fromkeys(p.depth for p in points):
        at = {p.method: p for p in points if p.depth == depth}
        plain = at[measure.PLAIN.name]
        rows.append(
            [
                depth,
                f"{plain.activation_mib:.1f}",
                *(f"{at[m].memory_ratio:.2f} ({at[m].time_ratio:.2f}x)" for m in methods),
            ]
        )
    page.table(["depth", "plain MiB", *methods], rows)
    page.text("Every point, and the slope of each method's memory against depth:")
    page.text(f"```text\n{report.table(points)}\n```")


def predicted_ratios(
    depth: int, shape: models.Shape, chosen: list[measure.Method]
) -> dict[str, float]:
    """Each checkpointing method's predicted activation peak over plain's, from its plan."""
    import tensorflow as tf

    import memory_saving_gradients as msg

    model = models.build("chain", depth, shape)
    ratios = {}

    @tf.function
    def trace() -> tf.Tensor:
        loss = model.loss(models.unwrapped)
        for method in chosen:
            if method.checkpoints is not None:
                plan = msg.plan(loss, list(model.variables), checkpoints=method.checkpoints)
                ratios[method.name] = plan.peak_bytes / plan.plain_peak_bytes
        return loss

    trace.get_concrete_function()
    return ratios
