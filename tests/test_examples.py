"""Every script in examples/ runs as a user would run it, and shows the memory it saves.

Each runs in a fresh interpreter (some configure devices, which only works before
TensorFlow's runtime starts). Scripts that print a plain and a checkpointed peak must show
the checkpointed one well below the plain one.
"""

import re

import pytest

from tests.helpers import ROOT, run_python

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PEAK = re.compile(r"peak activation memory (\d+) MiB")


def test_examples_are_found():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.stem)
def test_example_runs(script):
    stdout = run_python(str(script))
    peaks = [int(mib) for mib in PEAK.findall(stdout)]
    if peaks:
        plain, checkpointed = peaks
        assert checkpointed < 0.5 * plain, stdout
