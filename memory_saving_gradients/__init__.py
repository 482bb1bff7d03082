"""Gradient checkpointing for TensorFlow 2: fit deeper models by recomputing activations.

    import memory_saving_gradients as msg
    grads = msg.gradients(loss, variables, checkpoints="memory")   # in place of tf.gradients
    with msg.GradientTape(checkpoints="memory") as tape: ...       # in place of tf.GradientTape
    msg.keras.enable(model, checkpoints="memory")                  # Keras model.fit
    msg.patch("memory")   # or: every tf.gradients / Optimizer.minimize call checkpoints
    print(msg.plan(loss, variables, checkpoints="memory"))  # what it keeps, predicted peaks

Diagnostics go to `logging.getLogger("memory_saving_gradients")`.
"""

from memory_saving_gradients import keras
from memory_saving_gradients.api import (
    gradients,
    gradients_collection,
    gradients_memory,
    gradients_speed,
    plan,
)
from memory_saving_gradients.patch import patch, patched, unpatch
from memory_saving_gradients.plans import Plan
from memory_saving_gradients.strategies import (
    CHECKPOINTS_COLLECTION,
    MemoryBudget,
    NoCheckpointsError,
    add_checkpoint,
)
from memory_saving_gradients.tape import GradientTape
from memory_saving_gradients.view import ForwardView

__version__ = "0.1.0"

__all__ = [
    "CHECKPOINTS_COLLECTION",
    "ForwardView",
    "GradientTape",
    "MemoryBudget",
    "NoCheckpointsError",
    "Plan",
    "add_checkpoint",
    "gradients",
    "gradients_collection",
    "gradients_memory",
    "gradients_speed",
    "keras",
    "patch",
    "patched",
    "plan",
    "unpatch",
]
