"""One measurement in a fresh interpreter: `run_alone(function, **arguments)`.

TensorFlow's allocator keeps the blocks a process's earlier steps grew and hands a request a
free block of up to twice its size whole, so a step measured after a larger one can read more
than it needs; and settings such as inter-op threads or XLA's dump folder must come before
TensorFlow's runtime starts. Suites measure such points in an interpreter of their own, as a
user training one model has it.

    python -m memory_saving_gradients.cli.suites.isolated MODULE:FUNCTION JSON

runs `FUNCTION(**json)` of `memory_saving_gradients.cli.suites.MODULE` and prints its result,
JSON, on a line of its own after `RESULT_MARK`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

RESULT_MARK = "RESULT "


def run_alone(function: str, env: Mapping[str, str] | None = None, **arguments: Any) -> Any:
    """What `function` ("module:name" of this package's suites) returns, called with
    `arguments` in a fresh interpreter with `env` added to the environment.

    Raises:
      RuntimeError: the interpreter failed; the message ends with its stderr.
    """
    result = subprocess.run(
        [sys.executable, "-m", __name__, function, json.dumps(arguments)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if result.returncode or not lines:
        raise RuntimeError(f"{function}({arguments}) failed:\n{result.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_MARK) :])


def _main(function: str, arguments: str) -> None:
    from memory_saving_gradients.cli import runtime

    runtime.quiet()
    module, name = function.split(":")
    suite = importlib.import_module(f"memory_saving_gradients.cli.suites.{module}")
    print(RESULT_MARK + json.dumps(getattr(suite, name)(**json.loads(arguments))), flush=True)


if __name__ == "__main__":
    _main(*sys.argv[1:])
