"""`msg.keras.largest`: the largest size of a user's own Keras model that trains in a limit.

A tanh Dense chain grows its batch in steps of 64 rows; the search runs on Keras's own step,
plain and enabled, measured as the README's recipe measures (peak above resident).
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import memory_saving_gradients as msg  # noqa: E402

pytestmark = pytest.mark.tf2_only

ROWS, WIDTH, DEPTH = 64, 256, 6
LIMIT = 3 * 2**20


def dense_chain_at(batches: int):
    """A compiled chain of tanh Dense layers and a batch of `batches` * 64 rows."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(DEPTH):
        h = keras.layers.Dense(WIDTH, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    rows = batches * ROWS
    return model, np.ones((rows, WIDTH), "f4"), np.ones((rows, 1), "f4")


def test_checkpointing_fits_a_larger_batch_than_keras_plain_step():
    plain, memory = msg.keras.largest(
        dense_chain_at, LIMIT, [None, "memory"], lower=1, upper=32, repeats=1
    )
    assert (plain.name, memory.name) == ("plain", "'memory'")
    assert plain.size is not None and memory.size is not None
    assert memory.size > plain.size, (plain.probes, memory.probes)
    for found in (plain, memory):
        assert not found.capped
        assert 0 < found.peak_bytes <= LIMIT
        assert found.step_seconds > 0
        above = [probe for probe in found.probes if probe.value == found.size + 1]
        assert above and not above[0].fits, found.probes


def test_a_build_that_returns_no_batch_is_named():
    with pytest.raises(ValueError, match=r"build\(1\) returned a model and no batch"):
        msg.keras.largest(lambda n: (dense_chain_at(n)[0],), LIMIT, [None])


@pytest.mark.parametrize("limit, bounds", [(0, {}), (LIMIT, {"lower": 4, "upper": 2})])
def test_a_limit_or_bounds_that_leave_nothing_to_search_are_errors(limit, bounds):
    with pytest.raises(ValueError, match=r"limit_bytes|lower <= upper"):
        msg.keras.largest(dense_chain_at, limit, [None], **bounds)
