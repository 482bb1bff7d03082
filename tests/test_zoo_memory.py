"""'memory' needs the least memory on the model zoo, measured (tests/zoo.py at `zoo.SMALL`,
whose tensors TensorFlow's allocator statistics count), in float32 and under Keras's
mixed_float16 policy.

Peaks come from a fresh interpreter per dtype (tests/zoo_peaks.py) with one inter-op thread,
in which a step's peak repeats from step to step. They still move by up to ~15% between two
builds of the same step in one process (the executor reorders ready ops by its own cost
estimates, and TensorFlow's CPU allocator hands out a free block of less than twice a request
whole), so each comparison here is one whose margin was clear in every run, either way:

- 'memory' against the one-level strategies, 'speed' and 'balanced': it needs the least.
- 'memory' against budgets, which nest recomputation below 'memory''s peak: the issue asks
  for 'memory' to be the least there too, and it is not (strict xfails, naming the measured
  cause, so that they fail once 'memory' nests as well).

Left out, and measured by benchmarks/determinism.py instead: models whose comparison lies
within that noise (the Inception-style net; mixed_float16 MLP against budgets), convolutional
models under mixed_float16 (float16 convolution gradients on CPU allocate a working set of
their own of about 30 MiB, which makes every strategy's peak the same at these sizes), and
the layers-as-functions model (its peaks move by a third between runs).
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.helpers import run_python

#: The issue's tolerance: 'memory''s peak at most 5% above the least.
TOLERANCE = 0.05
MODELS = {"float32": ["mlp", "unet"], "mixed_float16": ["mlp"]}


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


@pytest.mark.xfail(
    strict=True,
    reason="'memory' is the least peak of one level of recomputation; MemoryBudget(0.25) "
    "nests recomputation (3-4 levels) and measures 8-16% less",
)
@pytest.mark.parametrize("name", MODELS["float32"])
def test_memory_needs_less_than_every_budget(name):
    assert_memory_least(peaks("float32")[name], ["MemoryBudget(0.25)", "MemoryBudget(0.5)"])
