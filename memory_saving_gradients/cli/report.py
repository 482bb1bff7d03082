"""Results as a text table, a CSV file and a plot of memory and time against depth."""

from __future__ import annotations

import csv
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from memory_saving_gradients._src.planning import policies
from memory_saving_gradients.cli.measure import PLAIN, Point

#: Curves the plot fits to methods' peaks: plain's grows with depth, 'memory''s (nested
#: recomputation on deep chains) with its logarithm.
FITS = {
    PLAIN.name: ("depth", np.asarray),
    policies.STRATEGIES["memory"].label: ("log(depth)", np.log),
}
#: One marker per method, so that methods measuring the same stay told apart.
MARKERS = "osD^vPX*"
_COLUMNS = (
    ("depth", "depth", "{:d}"),
    ("method", "method", "{}"),
    ("activation_mib", "activation MiB", "{:.1f}"),
    ("memory_ratio", "memory ratio", "{:.2f}"),
    ("step_s", "step s", "{:.3f}"),
    ("time_ratio", "time ratio", "{:.2f}x"),
    ("build_s", "build s", "{:.1f}"),
)


def aligned(rows: Sequence[Sequence[str]], text_column: int) -> list[str]:
    """`rows` (the header first) as lines of columns two spaces apart, numbers right-aligned
    and `text_column` (the method's name) left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i == text_column else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def table(points: Sequence[Point]) -> str:
    """One row per point, and where there are several depths the log-log slope of each
    method's memory against depth (1: linear, 0.5: sqrt)."""
    header = [title for _, title, _ in _COLUMNS]
    rows = [
        [form.format(getattr(point, field)) for field, _, form in _COLUMNS] for point in points
    ]
    lines = aligned([header, *rows], text_column=1)
    others = sorted(
        {f"; {p.method}: to {p.reference}" for p in points if p.reference != PLAIN.name}
    )
    lines.append("ratios: to plain at the same depth" + "".join(others))
    slopes = _memory_slopes(points)
    if slopes:
        listed = ", ".join(f"{method} {slope:.2f}" for method, slope in slopes.items())
        lines.append(f"log-log slope of memory against depth: {listed}")
    return "\n".join(lines)


def _memory_slopes(points: Sequence[Point]) -> dict[str, float]:
    """The exponent b of the least-squares fit memory ~ depth**b of each method measured at
    several depths (and never at 0 MiB)."""
    slopes = {}
    for method, (depths, values) in _series(points, "activation_mib").items():
        if len(set(depths)) > 1 and min(values) > 0:
            slopes[method] = float(np.polyfit(np.log(depths), np.log(values), 1)[0])
    return slopes


def write_csv(points: Sequence[Point], path: Path, setting: Mapping[str, object]) -> None:
    """One row per point, preceded by the columns of `setting` (model, batch, ...)."""
    fields = [field.name for field in dataclasses.fields(Point)]
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([*setting, *fields])
        for point in points:
            writer.writerow([*setting.values(), *(getattr(point, f) for f in fields)])


def plot(points: Sequence[Point], path: Path, title: str) -> None:
    """Two panels against depth: activation memory (with the `FITS` drawn through plain and
    'memory'), and step time as a multiple of plain's.

    Raises:
      ImportError: matplotlib is not installed (the `demo` extra).
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5), layout="constrained")
    memory_axes, time_axes = figure.subplots(1, 2)
    for (method, (depths, values)), marker in zip(
        _series(points, "activation_mib").items(), itertools.cycle(MARKERS)
    ):
        (line,) = memory_axes.plot(depths, values, marker=marker, label=method)
        fit = FITS.get(method)
        if fit and len(set(depths)) > 1:
            _draw_fit(memory_axes, depths, values, *fit, line.get_color())
    memory_axes.set(
        xlabel="depth", ylabel="peak activation memory (MiB)", title="Memory of one step"
    )
    memory_axes.set_ylim(bottom=0)
    memory_axes.legend(fontsize="small")
    references = {point.method: point.reference for point in points}
    for (method, (depths, ratios)), marker in zip(
        _series(points, "time_ratio").items(), itertools.cycle(MARKERS)
    ):
        reference = references[method]
        label = method if reference == PLAIN.name else f"{method} (to {reference})"
        time_axes.plot(depths, ratios, marker=marker, label=label)
    time_axes.axhline(1.0, color="grey", linewidth=0.8)
    time_axes.set(xlabel="depth", ylabel="step time / plain", title="Time of one step")
    time_axes.legend(fontsize="small")
    figure.suptitle(title)
    figure.savefig(path, dpi=110)


def _draw_fit(axes, depths, values, basis: str, of_depth, color: str) -> None:
    """A least-squares fit a * of_depth(depth) + b, dashed, labelled with its formula."""
    slope, intercept = np.polyfit(of_depth(np.asarray(depths, dtype=float)), values, 1)
    dense = np.linspace(min(depths), max(depths), 100)
    axes.plot(
        dense,
        slope * of_depth(dense) + intercept,
        "--",
        color=color,
        linewidth=1,
        label=f"fit {slope:.2f} * {basis} {'+' if intercept >= 0 else '-'} {abs(intercept):.1f}",
    )


def _series(points: Sequence[Point], field: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per method, in order of first appearance: its depths and its values of `field`."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for point in points:
        depths, values = series.setdefault(point.method, ([], []))
        depths.append(point.depth)
        values.append(getattr(point, field))
    return series
