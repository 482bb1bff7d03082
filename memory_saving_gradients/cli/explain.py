"""What each strategy would keep for a model, and why, without running a step."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.models import command as models
from memory_saving_gradients.planning import policies


def plans(
    name: str, depth: int, shape: models.Shape, names: Sequence[str], budgets: Sequence[float]
) -> str:
    """For each strategy of `names` and each budget: a heading, the first paragraph of its
    docstring (why it keeps what it keeps) and its plan for model `name`."""
    model = models.build(name, depth, shape)
    choices: list[str | msg.MemoryBudget] = [*names, *map(msg.MemoryBudget, budgets)]
    sections = []

    def trace() -> tf.Tensor:
        loss = model.loss(models.unwrapped)
        for checkpoints in choices:
            plan = msg.plan(loss, model.variables, checkpoints=checkpoints)
            sections.append(f"== {checkpoints!r}: {_why(checkpoints)}\n{plan}")
        return loss

    tf.function(trace).get_concrete_function()
    heading = f"{name} at depth {model.depth}, batch {shape.batch}, {shape.dtype}"
    return "\n\n".join([heading, *sections])


def _why(checkpoints: str | msg.MemoryBudget) -> str:
    """The first paragraph of the strategy's docstring, on one line."""
    strategy = policies.STRATEGIES.get(checkpoints) if isinstance(checkpoints, str) else None
    doc = inspect.getdoc(strategy.choose if strategy else type(checkpoints)) or ""
    return " ".join(doc.split("\n\n")[0].split())
