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

import ast
import importlib
from pathlib import Path

from memory_saving_gradients import _moved

__version__ = "0.1.0"


def _read_stub() -> dict[str, tuple[str, str]]:
    """Each public name -> the module it is made in and its name there, read from
    `__init__.pyi`, the one list of them (the one type checkers and IDEs read)."""
    stub = ast.parse(Path(__file__).with_suffix(".pyi").read_text())
    return {
        alias.asname or alias.name: (node.module or __name__, alias.name)
        for node in stub.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


#: Importing the package loads none of the public names (nor TensorFlow): the first use of a
#: name does, so a command can quiet TensorFlow before it starts.
_PUBLIC = _read_stub()
__all__ = sorted(_PUBLIC)

_moved.install()


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    if module == __name__:  # a public module: importing it sets it as an attribute here
        value = importlib.import_module(f"{module}.{attribute}")
    else:
        value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
