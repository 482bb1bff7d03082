"""Every script in examples/ runs as a user would run it, and shows the memory it saves.

Each runs in a fresh interpreter (some configure devices, which only works before
TensorFlow's runtime starts). Scripts that print a plain and a checkpointed peak must show
the checkpointed one well below the plain one.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PEAK = re.compile(r"peak activation memory (\d+) MiB")


def test_examples_are_found():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.stem)
def test_example_runs(script):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    peaks = [int(mib) for mib in PEAK.findall(result.stdout)]
    if peaks:
        plain, checkpointed = peaks
        assert checkpointed < 0.5 * plain, result.stdout
