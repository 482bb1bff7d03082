"""'memory' needs the least memory of the one-level strategies, measured on the model zoo
(_src/models/zoo.py at `zoo.SMALL`, whose tensors TensorFlow's allocator statistics count).

Peaks come from a fresh interpreter (tests/zoo_peaks.py) with one inter-op thread, in which a
step's peak repeats from step to step, and the step returns its gradients (held to its end).
They still move by up to ~15% between two builds of the same step in one process (the
executor reorders ready ops by its own cost estimates, and TensorFlow's CPU allocator hands out
a free block of less than twice a request whole), so the comparison here is the one whose
margin was clear in every run: the U-Net, 'memory' against 'speed' and 'balanced' (measured
12.7 MiB against 15.2 and 16.0).

Left out, and measured by `bench --suite determinism` instead: models whose comparison lies
within that noise (the MLP, whose peak is in its forward pass; the Inception-style net),
models under mixed_float16 (float16 convolution gradients on CPU allocate a working set of
about 30 MiB of their own, which makes every strategy's peak the same at these sizes), the
layers-as-functions model (its peaks move by a third between runs), and budgets: below
'memory''s peak they nest recomputation, by design, and measure less.
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.helpers import run_python

#: The issue's tolerance: 'memory''s peak at most 5% above the least.
TOLERANCE = 0.05
MODELS = {"float32": ["unet"]}


@functools.cache
def peaks(dtype: str) -> dict[str, dict[str, float]]:
    return json.loads(run_python("-m", "tests.zoo_peaks", dtype, *MODELS[dtype]))


def assert_memory_least(measured: dict[str, float], rivals: list[str]) -> None:
    least = min(rivals, key=measured.get)
    memory = measured["'memory'"]
    assert memory <= measured[least] * (1 + TOLERANCE), (
        f"'memory' {memory:.2f} MiB, {least} {measured[least]:.2f} MiB: {measured}"
    )


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(dtype, name) for dtype, names in MODELS.items() for name in names],
    ids=lambda value: value,
)
def test_memory_needs_less_than_the_one_level_strategies(dtype, name):
    assert_memory_least(peaks(dtype)[name], ["'speed'", "'balanced'"])
