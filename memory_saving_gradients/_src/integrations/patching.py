"""Route TensorFlow's gradient entry points to checkpointed gradients, and back.

`tf.gradients`, `tf.compat.v1.gradients` and the internal function that
`tf.compat.v1.train.Optimizer.minimize/compute_gradients` call are replaced by functions with
their exact signatures, so positional calls keep working. The library itself always calls
TensorFlow's own implementation, so patching never recurses.

Patched calls come from code the user may not have written (`tf.hessians`, libraries, small
helper graphs), so they never refuse: where the strategy finds nothing to keep, TensorFlow's
own gradients are computed and that is logged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.api import compute_gradients
from memory_saving_gradients._src.planning.policies import CheckpointsArg, check_checkpoints
from memory_saving_gradients._src.rewriting.backprop import GradientOptions

logger = logging.getLogger(__name__)


def _v1_signature(checkpoints: CheckpointsArg):
    """A replacement for `tf.compat.v1.gradients`, same parameters in the same order."""

    @tf.autograph.experimental.do_not_convert
    def checkpointed_gradients_v1(
        ys,
        xs,
        grad_ys=None,
        name="gradients",
        colocate_gradients_with_ops=False,
        gate_gradients=False,
        aggregation_method=None,
        stop_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        options = GradientOptions(
            name, colocate_gradients_with_ops, gate_gradients, aggregation_method
        )
        return compute_gradients(
            ys, xs, grad_ys, checkpoints, options, stop_gradients, unconnected_gradients,
            refuse=False,
        )  # fmt: skip

    return checkpointed_gradients_v1


def _v2_signature(checkpoints: CheckpointsArg):
    """A replacement for `tf.gradients` (TF2), same parameters in the same order."""
    checkpointed_gradients_v1 = _v1_signature(checkpoints)

    @tf.autograph.experimental.do_not_convert
    def checkpointed_gradients_v2(
        ys,
        xs,
        grad_ys=None,
        name="gradients",
        gate_gradients=False,
        aggregation_method=None,
        stop_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        return checkpointed_gradients_v1(
            ys, xs, grad_ys, name, True, gate_gradients, aggregation_method, stop_gradients,
            unconnected_gradients,
        )  # fmt: skip

    return checkpointed_gradients_v2


def patch(checkpoints: CheckpointsArg = "memory") -> None:
    """Make every TensorFlow gradient entry point compute checkpointed gradients.

    Calling it again switches the strategy; `unpatch` restores TensorFlow's own functions.

    Raises:
      ValueError, TypeError: `checkpoints` names no strategy or is of the wrong kind.
    """
    check_checkpoints(checkpoints)
    replacements = {"v1": _v1_signature(checkpoints), "v2": _v2_signature(checkpoints)}
    for point in _tf.gradient_entry_points():
        setattr(point.module, point.attribute, replacements[point.signature])
    logger.info("Patched TensorFlow gradients with checkpoints=%r.", checkpoints)


def unpatch() -> None:
    """Restore TensorFlow's own gradient functions."""
    for point in _tf.gradient_entry_points():
        setattr(point.module, point.attribute, point.original)


@contextlib.contextmanager
def patched(checkpoints: CheckpointsArg = "memory") -> Iterator[None]:
    """Patch for the duration of a `with` block, then restore what was there before."""
    before = [
        (point, getattr(point.module, point.attribute)) for point in _tf.gradient_entry_points()
    ]
    patch(checkpoints)
    try:
        yield
    finally:
        for point, function in before:
            setattr(point.module, point.attribute, function)
