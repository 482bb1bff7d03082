"""`fit`'s answers as a text table, a CSV file and a plot: how large each method trains."""

from __future__ import annotations

import csv
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

from memory_saving_gradients.cli.largest import MIB, Answer, Problem
from memory_saving_gradients.cli.report import MARKERS, aligned

CSV_FIELDS = (
    "method", "largest", "capped", "activation_mib", "step_s", "samples_per_s",
    "failing_value", "failing_mib", "probes", "note",
)  # fmt: skip


def samples_per_second(answer: Answer, problem: Problem) -> float | None:
    """Training samples a second at the largest value: its batch over its step time."""
    if answer.largest is None or answer.fitting is None or not answer.fitting.step_s:
        return None
    return problem.batch_at(answer.largest) / answer.fitting.step_s


def table(answers: Sequence[Answer], problem: Problem) -> str:
    """One row per method: the largest value, as a multiple of plain's, its step time,
    samples a second and activation peak; methods without an answer say why below."""
    plain = answers[0].largest if answers else None
    header = [
        "method", f"largest {problem.grow}", "x plain", "step s", "samples/s",
        "activation MiB", "probes",
    ]  # fmt: skip
    rows: list[list[str]] = []
    notes: list[str] = []
    for answer in answers:
        if answer.largest is None or answer.fitting is None:
            notes.append(f"({len(notes) + 1}) {answer.method}: {answer.note}")
            rows.append(
                [answer.method, f"- ({len(notes)})", "", "", "", "", str(len(answer.probes))]
            )
            continue
        rate = samples_per_second(answer, problem)
        rows.append(
            [
                answer.method,
                f"{'>=' if answer.capped else ''}{answer.largest}",
                f"{answer.largest / plain:.2f}" if plain else "",
                f"{answer.fitting.step_s:.3f}" if answer.fitting.step_s else "",
                f"{rate:.0f}" if rate else "",
                f"{answer.fitting.activation_mib:.1f}"
                if answer.fitting.activation_mib is not None
                else "",
                str(len(answer.probes)),
            ]
        )
    return "\n".join([*aligned([header, *rows], text_column=0), *notes])


def write_csv(
    answers: Sequence[Answer], problem: Problem, path: Path, setting: Mapping[str, object]
) -> None:
    """One row per method, preceded by the columns of `setting` (model, limit, ...)."""
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([*setting, *CSV_FIELDS])
        for answer in answers:
            fitting, failing = answer.fitting, answer.failing
            row = {
                "method": answer.method,
                "largest": answer.largest,
                "capped": answer.capped,
                "activation_mib": fitting.activation_mib if fitting else None,
                "step_s": fitting.step_s if fitting else None,
                "samples_per_s": samples_per_second(answer, problem),
                "failing_value": failing.value if failing else None,
                "failing_mib": failing.activation_mib if failing else None,
                "probes": len(answer.probes),
                "note": answer.note,
            }
            cells = ("" if row[field] is None else row[field] for field in CSV_FIELDS)
            writer.writerow([*setting.values(), *cells])


def plot(answers: Sequence[Answer], problem: Problem, path: Path, title: str) -> None:
    """Two panels: each method's largest value (bars), and every probe's activation peak
    against its value with the limit drawn across.

    Raises:
      ImportError: matplotlib is not installed (the `demo` extra).
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5), layout="constrained")
    bars, probes = figure.subplots(1, 2)
    names = [answer.method for answer in answers]
    values = [answer.largest or 0 for answer in answers]
    bars.barh(names, values)
    for y, answer in enumerate(answers):
        label = str(answer.largest) if answer.largest is not None else answer.note.split(":")[0]
        bars.annotate(
            label, (values[y], y), xytext=(3, 0), textcoords="offset points", va="center"
        )
    bars.invert_yaxis()
    bars.set(xlabel=f"largest {problem.grow} that fits", title="Largest that fits")
    for answer, marker in zip(answers, itertools.cycle(MARKERS)):
        measured = sorted(
            (p.value, p.activation_mib) for p in answer.probes if p.activation_mib is not None
        )
        if measured:
            xs, ys = zip(*measured, strict=True)
            probes.plot(xs, ys, marker=marker, linestyle=":", label=answer.method)
    probes.axhline(problem.limit_bytes / MIB, color="grey", linewidth=0.8, label="limit")
    probes.set(
        xlabel=problem.grow, ylabel="peak activation memory (MiB)", title="Probes of the search"
    )
    probes.legend(fontsize="small")
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
