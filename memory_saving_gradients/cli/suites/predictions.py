"""The cost model against TensorFlow: the activation peaks plans predict, from static costs
and from measured ones (`msg.measure_costs`), beside the peaks measured, and the step times
plans predict beside those measured.

Each model runs in a process of its own whose allocator was first grown
(`runtime.grow_allocator`), so that each request is cut to its size rather than served from
the blocks another model left. A step is a `tf.function` returning the gradients of every
variable: they are held to the end of the step, as the plans are told (`gradients_held`).
The plain step is profiled once (`measure_costs`); each method is then planned from the
static estimates and from those costs, and each step measured: the allocator's peak above
resident memory, the smallest of `builds` measurements, and the largest sum of bytes its live
tensors requested in one profiled step (`trace.profiled`). The simulator models requested
bytes; the allocator reads more where it hands a request a free block of up to twice its size
whole, and TensorFlow's CPU allocator does not count requests under 256 KiB. Errors are
against the measured peak; step times are the medians of each turn's ratio to plain's (steps
taken in turns, `msg.profiling.step_time_ratios`) and their middle half, beside each plan's
`time_ratio`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memory_saving_gradients._src.models import command as models
from memory_saving_gradients.cli import runtime
from memory_saving_gradients.cli.suites import isolated
from memory_saving_gradients.cli.suites.page import Page, number, progress

TITLE = "How close the predictions come"
MIB = 2**20
#: MiB of the free block each model's process makes first.
GROWN_MIB = 2048
#: The methods planned besides plain.
METHODS = ("memory", "balanced", "speed", "MemoryBudget(0.5)")


@dataclasses.dataclass(frozen=True)
class Case:
    """A model of the catalogue at one depth and shape."""

    model: str
    depth: int
    shape: models.Shape

    def describe(self) -> str:
        s = self.shape
        if self.model not in models.KINDS:
            return f"keras.applications.{self.model}, {s.size}x{s.size}, batch {s.batch}"
        kind = models.KINDS[self.model]
        sizes = f"batch {s.batch}, width {s.width}" + (f", size {s.size}" if s.size else "")
        return f"{self.model}, {self.depth} {kind.depth_counts}, {sizes}"


#: Models whose tensors are mostly far above the allocator's 256 KiB floor.
FULL = (
    Case("chain", 16, models.Shape(batch=2048, width=256, size=0)),
    Case("densenet", 8, models.Shape(batch=8, width=12, size=32)),
    Case("unet", 3, models.Shape(batch=4, width=16, size=64)),
    Case("transformer", 2, models.Shape(batch=8, width=64, size=128)),
    Case("MobileNetV2", 0, models.Shape(batch=8, width=0, size=96)),
)
QUICK = (Case("chain", 8, models.Shape(batch=512, width=128, size=0)),)


def run(page: Page, quick: bool, device: str) -> None:
    cases = QUICK if quick else FULL
    methods = METHODS[:1] if quick else METHODS
    builds, turns = (1, 2) if quick else (2, 15)
    page.text(
        "Each model in a process of its own, its allocator first grown by "
        f"{GROWN_MIB} MiB; a `tf.function` step returning the gradients of every variable, "
        f"float32, on {device}. *measured*: the allocator's peak above resident memory, the "
        f"smallest of {builds} steps; *requested*: the largest sum of bytes live tensors "
        "requested in one profiled step; errors are predicted over measured, less one; "
        f"*time*: the median of {turns} turns' ratios of a step's time to plain's in the same "
        "turn; *middle half*: the quartiles of those ratios."
    )
    page.text("Models: " + "; ".join(case.describe() for case in cases) + ".")
    header = [
        "model", "method", "static MiB", "error", "from measured costs MiB", "error",
        "measured MiB", "requested MiB", "time / plain", "middle half", "predicted time",
    ]  # fmt: skip
    rows = []
    for case in cases:
        progress(f"predictions: {case.describe()}")
        found = isolated.run_alone(
            "predictions:measure_case",
            model=case.model,
            depth=case.depth,
            shape=dataclasses.asdict(case.shape),
            methods=list(methods),
            builds=builds,
            turns=turns,
            device=device,
        )
        for row in found:
            measured = row["measured"]
            rows.append(
                [
                    case.model,
                    row["method"],
                    f"{row['static'] / MIB:.1f}",
                    f"{row['static'] / measured - 1:+.0%}" if measured else "",
                    f"{row['costs'] / MIB:.1f}",
                    f"{row['costs'] / measured - 1:+.0%}" if measured else "",
                    f"{measured / MIB:.1f}",
                    f"{row['requested'] / MIB:.1f}",
                    f"{row['time_ratio']:.2f}x",
                    f"{row['time_quartiles'][0]:.2f}-{row['time_quartiles'][1]:.2f}x",
                    number(row["predicted_time"], "{:.2f}x"),
                ]
            )
    page.table(header, rows)


def measure_case(
    model: str,
    depth: int,
    shape: dict[str, Any],
    methods: list[str],
    builds: int,
    turns: int,
    device: str,
) -> list[dict[str, Any]]:
    """Plain and each method on `model`, predicted from static and measured costs and
    measured; in a fresh interpreter (`isolated.run_alone`)."""
    import tensorflow as tf

    import memory_saving_gradients as msg
    from memory_saving_gradients.cli.suites import trace
    from memory_saving_gradients.profiling import peak_memory, step_time_ratios

    runtime.grow_allocator(GROWN_MIB, device)
    built = models.build(model, depth, models.Shape(**shape))
    variables = list(built.variables)
    plans: dict[str, Any] = {}

    def step(label: str, checkpoints: Any = None, costs: Any = None) -> Any:
        @tf.function
        def gradients() -> list[tf.Tensor]:
            loss = built.loss(models.unwrapped)
            if checkpoints is None:
                found = tf.gradients(loss, variables)
            else:
                plans[label] = plan = msg.plan(
                    loss, variables, checkpoints=checkpoints, costs=costs, gradients_held=True
                )
                found = msg.gradients(loss, variables, checkpoints=plan, gradients_held=True)
            return tf.nest.flatten([g for g in found if g is not None], expand_composites=True)

        def run() -> object:
            return [t.numpy() for t in gradients()]

        return run

    steps = {"plain": step("plain")}
    costs = msg.measure_costs(steps["plain"], device)
    for name in methods:
        checkpoints = msg.MemoryBudget(0.5) if name == "MemoryBudget(0.5)" else name
        steps[f"{name} static"] = step(f"{name} static", checkpoints)
        steps[name] = step(name, checkpoints, costs)
    measured, requested = {}, {}
    for label, run in steps.items():
        run()
        measured[label] = min(peak_memory(run, device) for _ in range(builds))
        requested[label] = trace.profiled(run, device).requested_peak
    times = step_time_ratios({name: steps[name] for name in ("plain", *methods)}, "plain", turns)
    first = methods[0]
    rows = [
        {
            "method": "plain",
            "static": plans[f"{first} static"].plain_peak_bytes,
            "costs": plans[first].plain_peak_bytes,
            "measured": measured["plain"],
            "requested": requested["plain"],
            "time_ratio": 1.0,
            "time_quartiles": (1.0, 1.0),
            "predicted_time": None,
        }
    ]
    for name in methods:
        rows.append(
            {
                "method": f"'{name}'" if name in ("memory", "balanced", "speed") else name,
                "static": plans[f"{name} static"].peak_bytes,
                "costs": plans[name].peak_bytes,
                "measured": measured[name],
                "requested": requested[name],
                "time_ratio": times[name].median,
                "time_quartiles": (times[name].lower_quartile, times[name].upper_quartile),
                "predicted_time": plans[name].time_ratio,
            }
        )
    return rows
