"""What each strategy would keep for a model, and why, without running a step.

Each plan is headed by a sentence for the command's user saying what the strategy aims at;
the strategies' docstrings are written for the library's readers and name its internals.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import command as models
from memory_saving_gradients._src.planning import tunables

#: What each named strategy keeps, in the words of its `checkpoints=` argument's user.
WHY = {
    "speed": "keeps the outputs of matmuls and convolutions, the expensive ops, and "
    "recomputes only cheap ones (activations, normalisations), each once: the least "
    "recomputation, for a smaller saving.",
    "memory": "the least predicted peak: kept tensors cut the forward pass into segments "
    "that backprop recomputes once, and nested cuts (segments cut again) hold less for about "
    "one more forward pass a level; of the plans within "
    f"{tunables.NESTING_GAIN:.0%} of the least peak, the one recomputing least.",
    "balanced": "most of the saving for less recomputation: the least recomputation whose "
    "predicted peak is one level of cuts' least plus a third of what that level saves (the "
    "last part of the forward pass that fits is not recomputed at all).",
}


def plans(
    name: str, depth: int, shape: models.Shape, names: Sequence[str], budgets: Sequence[float]
) -> str:
    """For each strategy of `names` and each budget: a heading saying what it aims at, and its
    plan for model `name`."""
    model = models.build(name, depth, shape)
    choices: list[str | msg.MemoryBudget] = [*names, *map(msg.MemoryBudget, budgets)]
    sections = []

    def trace() -> tf.Tensor:
        loss = model.loss(models.unwrapped)
        for checkpoints in choices:
            plan = msg.plan(loss, model.variables, checkpoints=checkpoints)
            sections.append(f"== {checkpoints!r}: {why(checkpoints)}\n{plan}")
        return loss

    tf.function(trace).get_concrete_function()
    heading = f"{name} at depth {model.depth}, batch {shape.batch}, {shape.dtype}"
    return "\n\n".join([heading, *sections])


def why(checkpoints: str | msg.MemoryBudget) -> str:
    """One sentence on what `checkpoints` (a strategy's name, or a budget) aims at."""
    if isinstance(checkpoints, str):
        return WHY[checkpoints]
    assert checkpoints.fraction is not None  # the command's budgets are fractions
    return (
        "the least recomputation whose predicted peak is at most "
        f"{checkpoints.fraction:.0%} of plain backprop's; where no plan gets that low, the "
        "plan of 'memory'."
    )
