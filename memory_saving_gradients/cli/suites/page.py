"""A suite's results page: a markdown file headed with where and when it was measured.

Every figure on a results page comes from the run that wrote it, so the header reads the
machine, the versions and the date from the environment at run time, and gives the command
that makes the page again.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: The command every page is made by; the suite's options follow.
COMMAND = "python -m memory_saving_gradients bench --suite"


def cpu_model() -> str:
    """The processor's name as the OS reports it, or the architecture where it reports none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """The GPUs TensorFlow sees, by the name their driver gives."""
    import tensorflow as tf

    names = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        names.append(details.get("device_name", gpu.name))
    return names


def environment() -> dict[str, str]:
    """Machine, versions and date of this run, as a page's header lists them."""
    import keras
    import tensorflow as tf

    from memory_saving_gradients.cli.options import version

    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "machine": f"{cpu_model()}, {len(cores) if cores else os.cpu_count()} cores",
        "GPU": ", ".join(gpu_names()) or "none",
        "Python": platform.python_version(),
        "TensorFlow": tf.__version__,
        "Keras": keras.__version__,
        "memory_saving_gradients": version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def load_average() -> float | None:
    """The system's load over the last minute, where the OS reports one: beside the number
    of cores, it says whether other work shared them while steps were timed."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def number(value: float | None, form: str = "{:.2f}") -> str:
    """A table cell: `value` formatted, or empty where there is none."""
    return "" if value is None else form.format(value)


class Page:
    """The markdown of one suite's results, written to `folder/<suite>.md` (plots beside it).

    Attributes:
      suite: the suite's name, the page's file name.
      folder: where the page and its plots are written.
      options: the command-line options besides `--suite` that made the page (`--quick`).
    """

    def __init__(self, suite: str, title: str, folder: Path, options: Sequence[str]) -> None:
        self.suite = suite
        self.folder = folder
        self.options = list(options)
        self._parts = [f"# {title}\n"]
        self._load_at_start = load_average()

    @property
    def command(self) -> str:
        return " ".join([COMMAND, self.suite, *self.options])

    def text(self, markdown: str) -> None:
        """A paragraph (or a heading, a list) of the page."""
        self._parts.append(markdown.strip() + "\n")

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A markdown table; each cell as `str` makes it."""
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
        self._parts.append("\n".join(lines) + "\n")

    def plot(self, name: str, draw: Callable[[Path], None], caption: str) -> None:
        """A PNG plot `draw(path)` makes, shown on the page; left out, and said so, where
        matplotlib is not installed (the `demo` extra)."""
        path = self.folder / f"{self.suite}{'-' + name if name else ''}.png"
        try:
            draw(path)
        except ImportError:
            self.text(f"*No plot of {caption}: matplotlib is missing (`pip install matplotlib`).*")
            return
        self._parts.append(f"![{caption}]({path.name})\n")

    def write(self, seconds: float) -> Path:
        """Write the page, headed by the environment of this run; returns its path."""
        header = [f"- **{key}:** {value}" for key, value in environment().items()]
        header.append(f"- **took:** {seconds:.0f} s")
        load_at_end = load_average()
        if self._load_at_start is not None and load_at_end is not None:
            header.append(
                f"- **load average:** {self._load_at_start:.1f} as it started, "
                f"{load_at_end:.1f} as it ended"
            )
        reproduce = f"Made by\n\n```bash\n{self.command}\n```\n"
        title, *body = self._parts
        path = self.folder / f"{self.suite}.md"
        path.write_text("\n".join([title, reproduce, "\n".join(header) + "\n", *body]))
        return path


def progress(line: str) -> None:
    """A line of a suite's progress, on stderr: stdout carries the tables."""
    print(line, file=sys.stderr, flush=True)
