"""The suites of `bench --suite`: each measures one question the results pages answer and
writes its page (`docs/results/<suite>.md`, plots beside it), headed with the machine, the
versions and the date it ran on, so that no figure on a results page is pasted.

Each suite is a module here with a `TITLE` and `run(page, quick, device)`; the modules import
TensorFlow, so they are imported only when their suite runs. `--quick` runs each at sizes two
CPU cores measure in a minute or two, for tests; without it, at the sizes its page shows.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from pathlib import Path

#: Each suite, and what its page shows.
SUITES = {
    "chain": "memory and step time against depth on deep tanh(matmul) chains, and the "
    "budgets between plain's memory and 'memory''s",
    "predictions": "predicted activation peaks, from static and from measured costs, "
    "against measured ones, and the allocator's rounding",
    "determinism": "how far peaks move between steps of the model zoo, and what the "
    "allocator rounds",
    "mixed_precision": "'memory' against plain under a Keras mixed-precision policy and in "
    "float32, on the model zoo",
    "fit": "Keras fit: each method's peak in a process of its own, its prediction and its "
    "step time",
    "xla": "memory and time with XLA off and on, in fresh and grown allocators",
    "build_time": "seconds to build a checkpointed step on large graphs, against plain's",
}


def run(
    name: str, folder: Path, device: str, quick: bool = False, options: Sequence[str] = ()
) -> Path:
    """Run suite `name` on `device` ('CPU:0' or 'GPU:0') and write its page into `folder`;
    returns the page's path. `options` are those of the command that reproduces the page."""
    from memory_saving_gradients.cli.suites.page import Page

    suite = importlib.import_module(f"{__name__}.{name}")
    folder.mkdir(parents=True, exist_ok=True)
    page = Page(name, suite.TITLE, folder, options)
    start = time.perf_counter()
    suite.run(page, quick, device)
    return page.write(time.perf_counter() - start)
