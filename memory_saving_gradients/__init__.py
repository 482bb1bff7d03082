"""Gradient checkpointing for TensorFlow 2: fit deeper models by recomputing activations.

    import memory_saving_gradients as msg
    grads = msg.gradients(loss, variables, checkpoints="memory")   # in place of tf.gradients
    with msg.GradientTape(checkpoints="memory") as tape: ...       # in place of tf.GradientTape
    msg.keras.enable(model, checkpoints="memory")                  # Keras model.fit
    msg.patch("memory")   # or: every tf.gradients / Optimizer.minimize call checkpoints
    print(msg.plan(loss, variables, checkpoints="memory"))  # what it keeps, predicted peaks

Diagnostics go to `logging.getLogger("memory_saving_gradients")`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: Where each public name lives. Importing the package loads none of them (nor TensorFlow):
#: the first use of a name does, so a command can quiet TensorFlow before it starts.
_PUBLIC = {
    "CHECKPOINTS_COLLECTION": "policies",
    "ForwardView": "view",
    "GradientTape": "tape",
    "MemoryBudget": "policies",
    "NoCheckpointsError": "policies",
    "Plan": "plans",
    "add_checkpoint": "policies",
    "gradients": "api",
    "gradients_collection": "api",
    "gradients_memory": "api",
    "gradients_speed": "api",
    "patch": "patch",
    "patched": "patch",
    "plan": "api",
    "unpatch": "patch",
}

if TYPE_CHECKING:
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
    from memory_saving_gradients.policies import (
        CHECKPOINTS_COLLECTION,
        MemoryBudget,
        NoCheckpointsError,
        add_checkpoint,
    )
    from memory_saving_gradients.tape import GradientTape
    from memory_saving_gradients.view import ForwardView


def __getattr__(name: str):
    if name == "keras":
        return importlib.import_module("memory_saving_gradients.keras")
    if name not in _PUBLIC:
        raise AttributeError(f"module 'memory_saving_gradients' has no attribute {name!r}")
    module = importlib.import_module(f"memory_saving_gradients.{_PUBLIC[name]}")
    # Every public name of that module at once: importing `patch.py` sets this package's
    # `patch` to the module, which the function of that name must replace.
    globals().update({n: getattr(module, n) for n, m in _PUBLIC.items() if m == _PUBLIC[name]})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC, "keras"])


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
