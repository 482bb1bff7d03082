"""The plot suites share: step time against activation memory, both over plain's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def frontier(
    points: Sequence[tuple[str, float, float]], path: Path, title: str, joined: str = ""
) -> None:
    """One point per method, (name, memory ratio, time ratio), named beside it; the methods
    whose names start with `joined` (budgets) joined by a line, in the order given.

    Raises:
      ImportError: matplotlib is not installed (the `demo` extra).
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.subplots()
    line = [(memory, time) for name, memory, time in points if joined and name.startswith(joined)]
    if len(line) > 1:
        axes.plot(*zip(*line, strict=True), "-", color="0.7")
    for name, memory, time in points:
        axes.plot(memory, time, "o")
        axes.annotate(name, (memory, time), fontsize=8, xytext=(4, 4), textcoords="offset points")
    axes.set_xscale("log")
    axes.set(xlabel="activation memory / plain (log)", ylabel="step time / plain")
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    figure.savefig(path, dpi=110)
