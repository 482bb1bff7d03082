"""What a Keras optimizer's update of one variable holds beside the gradient it applies.

An enabled step applies each gradient as soon as it is made, and the update's own
temporaries are alive beside it while it runs: Adam's `(g - m)` and `g * g`, RMSprop's more,
as many bytes again as the variable for each. Where weights are as large as activations (a
wide MLP, a language model's embedding) they move the peak, and plans count them
(`ForwardView.update_scratch`). TensorFlow gives no way to read them off the optimizer, so
they are measured: a copy of the optimizer (`from_config`) updates a probe variable in a
function of its own, once per optimizer, as the enabled step applies it (SGD's momentum fused
into one kernel: NOTE [fused momentum] in `keras.py`). That is done before any step runs: while
a step is traced it would make Keras trace it again (the probe is a new variable), and within a
batch it would reset the allocator statistics `MemoryLog` reads.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import statistics
import weakref
from collections.abc import Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from memory_saving_gradients._src.profiling import peak_memory

logger = logging.getLogger(__name__)

#: How the step applies gradients: a context, given the optimizer, gradients and variables,
#: inside which `optimizer.apply` runs.
Applying = Callable[
    [keras.optimizers.Optimizer, list, list], contextlib.AbstractContextManager[None]
]

#: Elements of the probe variable (16 MiB): large beside the blocks earlier steps of a
#: process leave free, which the allocator may hand a smaller request whole.
PROBE_ELEMENTS = 2**22
#: Updates measured, of which the median counts: one run alone may read a temporary less (a
#: suite's worker once read Adam's two as one) or a block more.
PROBE_RUNS = 5

_MEASURED: weakref.WeakKeyDictionary[keras.optimizers.Optimizer, float] = (
    weakref.WeakKeyDictionary()
)


def measure(optimizer: keras.optimizers.Optimizer, device: str, applying: Applying) -> None:
    """Measure `update_scratch` of `optimizer` on `device`, applied under `applying`, unless
    it was measured before; eagerly, before any step. Where the optimizer cannot be copied or
    the device keeps no memory statistics it stays 0, which is logged."""
    if optimizer in _MEASURED:
        return
    try:
        _MEASURED[optimizer] = _measured(optimizer, device, applying)
    except (TypeError, ValueError, NotImplementedError, tf.errors.OpError) as error:
        logger.info(
            "Could not measure what %s's update holds beside each gradient (%s): predicted "
            "peaks leave it out.",
            type(optimizer).__name__,
            error,
        )
        _MEASURED[optimizer] = 0.0


def update_scratch(optimizer: keras.optimizers.Optimizer) -> float:
    """The bytes `optimizer`'s update of one float32 variable holds beside the gradient
    it applies, over the gradient's bytes, as `measure` found (0 where it was not measured)."""
    return _MEASURED.get(optimizer, 0.0)


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's garbage collected once, then not again until the block ends: garbage freed
    during an update would read as less than it holds. One collection, not one per update:
    in a process holding many models each takes a good part of a second."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _measured(optimizer: keras.optimizers.Optimizer, device: str, applying: Applying) -> float:
    """`update_scratch` of a copy of `optimizer`, applying a gradient made in the function
    that applies it, so that the update may take its buffer over as the step's does."""
    probe = type(optimizer).from_config(optimizer.get_config())
    variable = keras.Variable(np.zeros([PROBE_ELEMENTS], np.float32))
    probe.build([variable])

    @tf.function
    def update() -> None:
        gradient = tf.sqrt(tf.abs(variable.value) + 1.0)
        with applying(probe, [gradient], [variable]):
            probe.apply([gradient], [variable])

    gradient_bytes = 4 * PROBE_ELEMENTS
    with _collection_paused():
        peaks = [peak_memory(update, device) for _ in range(PROBE_RUNS)]
    # The temporaries are whole buffers of the probe's size: counted in whole gradients,
    # rounded down, since a request handed a larger free block whole reads above them.
    return float(max(0, math.floor(statistics.median(peaks) / gradient_bytes - 1)))
