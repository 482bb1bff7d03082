"""Gradient checkpointing for TensorFlow 2: fit deeper models by recomputing activations.

    import memory_saving_gradients as msg
    grads = msg.gradients(loss, variables, checkpoints="memory")   # in place of tf.gradients
    with msg.GradientTape(checkpoints="memory") as tape: ...       # in place of tf.GradientTape
    msg.keras.enable(model, checkpoints="memory")                  # Keras model.fit
    msg.patch("memory")   # or: every tf.gradients / Optimizer.minimize call checkpoints
    print(msg.plan(loss, variables, checkpoints="memory"))  # what it keeps, predicted peaks
    costs = msg.measure_costs(plain_step)   # then costs=costs: plan from measured kernels

Diagnostics go to `logging.getLogger("memory_saving_gradients")`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from memory_saving_gradients import _moved

#: Where each public name lives. Importing the package loads none of them (nor TensorFlow):
#: the first use of a name does, so a command can quiet TensorFlow before it starts.
_PUBLIC = {
    "CHECKPOINTS_COLLECTION": "_src.planning.policies",
    "ForwardView": "_src.analysis.view",
    "GradientTape": "_src.integrations.tape",
    "MeasuredCosts": "_src.analysis.measured",
    "MemoryBudget": "_src.planning.policies",
    "NoCheckpointsError": "_src.planning.policies",
    "Plan": "_src.planning.plans",
    "add_checkpoint": "_src.planning.policies",
    "gradients": "_src.api",
    "gradients_collection": "_src.api",
    "gradients_memory": "_src.api",
    "gradients_speed": "_src.api",
    "measure_costs": "profiling",
    "patch": "_src.integrations.patching",
    "patched": "_src.integrations.patching",
    "plan": "_src.api",
    "unpatch": "_src.integrations.patching",
}
#: Public modules, by the name the package gives them.
_MODULES = {"keras": "keras", "profiling": "profiling"}

_moved.install()

if TYPE_CHECKING:
    from memory_saving_gradients import keras, profiling
    from memory_saving_gradients._src.analysis.measured import MeasuredCosts
    from memory_saving_gradients._src.analysis.view import ForwardView
    from memory_saving_gradients._src.api import (
        gradients,
        gradients_collection,
        gradients_memory,
        gradients_speed,
        plan,
    )
    from memory_saving_gradients._src.integrations.patching import patch, patched, unpatch
    from memory_saving_gradients._src.integrations.tape import GradientTape
    from memory_saving_gradients._src.planning.plans import Plan
    from memory_saving_gradients._src.planning.policies import (
        CHECKPOINTS_COLLECTION,
        MemoryBudget,
        NoCheckpointsError,
        add_checkpoint,
    )
    from memory_saving_gradients.profiling import measure_costs


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(f"memory_saving_gradients.{_MODULES[name]}")
    elif name in _PUBLIC:
        module = importlib.import_module(f"memory_saving_gradients.{_PUBLIC[name]}")
        value = getattr(module, name)
    else:
        raise AttributeError(f"module 'memory_saving_gradients' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC, *_MODULES])


__version__ = "0.1.0"

__all__ = [
    "CHECKPOINTS_COLLECTION",
    "ForwardView",
    "GradientTape",
    "MeasuredCosts",
    "MemoryBudget",
    "NoCheckpointsError",
    "Plan",
    "add_checkpoint",
    "gradients",
    "gradients_collection",
    "gradients_memory",
    "gradients_speed",
    "keras",
    "measure_costs",
    "patch",
    "patched",
    "plan",
    "profiling",
    "unpatch",
]
