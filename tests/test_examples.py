"""Every script in examples/ runs as a user would run it, and shows the memory it saves.

Each runs in a fresh interpreter (some configure devices or a cluster, which only works before
TensorFlow's runtime starts); those whose full size takes minutes run at the size their
--tiny flag sets. Scripts print peaks in pairs, plain then checkpointed (one pair per worker
in multi_worker): each checkpointed peak must be well below its plain one. Each also compares
its checkpointed gradients with TensorFlow's (one line per worker in multi_worker), which
must equal them to float32 round-off, relative to the largest entry.
"""

import re

import pytest

from tests.helpers import ROOT, run_python

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
#: Examples whose full size takes minutes on two cores.
TAKE_TINY = {"cifar_resnet_fit", "multi_worker", "pixelcnn", "transformer_lm_tape"}
PEAK = re.compile(r"peak activation memory (\d+) MiB")
DIFFERENCE = re.compile(r"differ from tf\.gradients by (\S+) at most")


def test_examples_are_found():
    names = {script.stem for script in EXAMPLES}
    assert len(names) >= 7
    assert names >= TAKE_TINY


@pytest.mark.parametrize("script", EXAMPLES, ids=[script.stem for script in EXAMPLES])
def test_example_runs(script):
    stdout = run_python(str(script), *(["--tiny"] if script.stem in TAKE_TINY else []))
    peaks = [int(mib) for mib in PEAK.findall(stdout)]
    assert peaks and len(peaks) % 2 == 0, stdout
    for plain, checkpointed in zip(peaks[::2], peaks[1::2], strict=True):
        assert checkpointed < 0.5 * plain, stdout
    differences = [float(d) for d in DIFFERENCE.findall(stdout)]
    assert len(differences) == len(peaks) // 2, stdout
    assert all(d < 1e-4 for d in differences), stdout
