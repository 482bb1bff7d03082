"""Checkpoint selection: which forward tensors to keep, by strategy name or explicit list.

Every strategy returns candidate tensors; `select_checkpoints` then keeps those that can serve
(made by a recomputable op between xs and ys), logs the others with the reason, and raises a
clear error when nothing usable is left.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import tensorflow as tf

from memory_saving_gradients import _tf
from memory_saving_gradients.planner import Plan, plan_checkpoints
from memory_saving_gradients.rewrite import ops_recomputed_repeatedly
from memory_saving_gradients.view import ForwardView

logger = logging.getLogger("memory_saving_gradients")

#: Name of the graph collection read by the 'collection' strategy.
CHECKPOINTS_COLLECTION = "checkpoints"

#: Op types whose outputs the 'speed' strategy keeps: recomputing them costs the most.
EXPENSIVE_OP_TYPES = frozenset(
    {
        "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv", "Conv2D",
        "Conv2DBackpropInput", "Conv3D", "Conv3DBackpropInputV2", "DepthwiseConv2dNative",
        "Einsum", "MatMul", "SparseMatMul",
    }
)  # fmt: skip


class NoCheckpointsError(ValueError):
    """No usable checkpoint between xs and ys; the message says what to try instead."""


def add_checkpoint(tensor: tf.Tensor) -> tf.Tensor:
    """Add `tensor` to its graph's 'checkpoints' collection and return it, for inline use."""
    tensor.graph.add_to_collection(CHECKPOINTS_COLLECTION, tensor)
    return tensor


def from_collection(view: ForwardView) -> list[tf.Tensor]:
    """The tensors added to the 'checkpoints' collection of the graph."""
    return view.ys[0].graph.get_collection(CHECKPOINTS_COLLECTION)


def speed(view: ForwardView) -> list[tf.Tensor]:
    """Outputs of matmuls and convolutions, and of function calls (nested `tf.function`s,
    control flow) that run one: only cheap ops are recomputed, each once.

    Where a path escapes them (the skip path of a residual network), every segment behind it
    would recompute it again, so the last ops of such paths are kept too.
    """
    kept = {
        out.ref(): out
        for op in view.ops
        if op in view.recomputable and _is_expensive(op)
        for out in op.outputs
    }
    while repeated := ops_recomputed_repeatedly(view, list(kept.values())):
        kept.update(
            (out.ref(), out)
            for op in repeated
            for out in op.outputs
            if any(reader not in repeated for reader in view.consumers(out))
        )
    return list(kept.values())


def _is_expensive(op: tf.Operation) -> bool:
    return op.type in EXPENSIVE_OP_TYPES or not EXPENSIVE_OP_TYPES.isdisjoint(
        _tf.called_op_types(op)
    )


def memory(view: ForwardView) -> list[tf.Tensor]:
    """Cuts of the forward pass chosen to minimise the estimated peak (about sqrt(2N) on chains).

    When no set of cuts lowers the estimated peak (tiny graphs), this is empty and gradients
    are computed as `tf.gradients` does, which is logged.
    """
    plan = plan_checkpoints(view)
    _log_plan("'memory'", plan)
    return list(plan.checkpoints)


@dataclasses.dataclass(frozen=True, repr=False)
class MemoryBudget:
    """Checkpoints that recompute as little as possible while the estimated peak of the
    backward pass stays within `fraction` of what plain backprop holds.

    'memory' buys the smallest peak by recomputing nearly the whole forward pass. A budget
    spends memory on speed: backprop runs on the original activations of the longest final
    part of the forward pass that fits, and only the part before it is recomputed. Pass it
    wherever `checkpoints` is accepted, e.g. `checkpoints=MemoryBudget(0.25)`. When no cuts
    fit, the smallest peak's are used (logged); at 1 or more nothing is recomputed.
    """

    fraction: float

    def __post_init__(self) -> None:
        number = isinstance(self.fraction, int | float) and not isinstance(self.fraction, bool)
        if not number or not self.fraction > 0:
            raise ValueError(
                f"MemoryBudget takes a fraction of plain backprop's peak above 0 (e.g. 0.3), "
                f"got {self.fraction!r}."
            )

    def __repr__(self) -> str:
        return f"MemoryBudget({self.fraction:.3g})"

    def choose(self, view: ForwardView) -> list[tf.Tensor]:
        """The checkpoints for `view`."""
        plan = plan_checkpoints(view, peak_fraction=self.fraction)
        if plan.estimated_peak > self.fraction * plan.estimated_peak_without_checkpoints:
            logger.warning(
                "No checkpoints fit %r: the smallest estimated peak is %.2f of plain "
                "backprop's; using the checkpoints that give it.",
                self,
                plan.estimated_peak / plan.estimated_peak_without_checkpoints,
            )
        _log_plan(repr(self), plan)
        return list(plan.checkpoints)


def _log_plan(source: str, plan: Plan) -> None:
    logger.info(
        "%s keeps %d tensors; estimated peak %.1f MB with them, %.1f MB without.",
        source,
        len(plan.checkpoints),
        plan.estimated_peak / 1e6,
        plan.estimated_peak_without_checkpoints / 1e6,
    )


#: The 'balanced' strategy's budget. Measured on a 56-block residual CNN under Keras `fit`
#: (benchmarks/keras_resnet.py): a third of plain backprop's peak cut activation memory 2.96x at
#: 1.25x the plain step time, where 'memory' cut it 8.8x at 1.35x.
BALANCED = MemoryBudget(1 / 3)

CheckpointsArg = str | MemoryBudget | Sequence[tf.Tensor | str]

STRATEGIES: dict[str, Callable[[ForwardView], list[tf.Tensor]]] = {
    "collection": from_collection,
    "speed": speed,
    "memory": memory,
    "balanced": BALANCED.choose,
}

#: Kinds of checkpoints chosen by the planner, which may choose none.
PLANNED = frozenset({"memory", "balanced", "budget"})

_ADVICE = {
    "collection": "add tensors with memory_saving_gradients.add_checkpoint(t), "
    "or use checkpoints='memory' to choose them automatically",
    "speed": "the forward pass has no matmul or convolution to keep; "
    "use checkpoints='memory' or pass a list of tensors",
    "list": "pass tensors computed from xs on the way to ys, or use checkpoints='memory'",
}


def select_checkpoints(view: ForwardView, checkpoints: CheckpointsArg) -> list[tf.Tensor]:
    """The usable checkpoints for `view` from a strategy name or a list of tensors/names.

    Raises:
      ValueError: `checkpoints` names no strategy.
      TypeError: a list entry is not a tensor or tensor name of the graph of ys.
      NoCheckpointsError: nothing usable remains (except for planned checkpoints: 'memory',
        'balanced' and budgets may choose none, and then gradients are plain).
    """
    if isinstance(checkpoints, str):
        if checkpoints not in STRATEGIES:
            raise ValueError(
                f"Unknown checkpoint strategy {checkpoints!r}: use one of "
                f"{sorted(STRATEGIES)} or a list of tensors."
            )
        kind, candidates = checkpoints, STRATEGIES[checkpoints](view)
    elif isinstance(checkpoints, MemoryBudget):
        kind, candidates = "budget", checkpoints.choose(view)
    else:
        kind, candidates = "list", _as_tensors(view, checkpoints)
    usable = _usable(view, candidates)
    if not usable and kind not in PLANNED:
        source = "the checkpoint list" if kind == "list" else f"checkpoints={kind!r}"
        raise NoCheckpointsError(
            f"{source} gave no tensor between xs and ys that can be recomputed from: "
            f"{_ADVICE[kind]}."
        )
    return usable


def _as_tensors(view: ForwardView, entries: Sequence[tf.Tensor | str]) -> list[tf.Tensor]:
    """Resolve a user's checkpoint list into tensors of the graph of ys, or raise TypeError."""
    if not isinstance(entries, Sequence):
        raise TypeError(
            f"checkpoints must be a strategy name, a MemoryBudget or a list of tensors, got "
            f"{entries!r}."
        )
    graph = view.ys[0].graph
    tensors = []
    for entry in entries:
        if isinstance(entry, str):
            try:
                entry = graph.get_tensor_by_name(entry)
            except (KeyError, ValueError) as error:
                raise TypeError(
                    f"Checkpoint name {entry!r} is no tensor of the graph of ys ({error}); "
                    "tensor names look like 'dense/Tanh:0'."
                ) from None
        if isinstance(entry, tf.Operation):
            raise TypeError(
                f"Checkpoint {entry.name!r} is an operation; pass one of its outputs, "
                f"e.g. {entry.name}.outputs[0]."
            )
        if not isinstance(entry, tf.Tensor) or not hasattr(entry, "graph"):
            raise TypeError(f"Checkpoint {entry!r} is not a graph tensor.")
        if entry.graph is not graph:
            raise TypeError(
                f"Checkpoint {entry.name} belongs to another graph than ys; pass tensors "
                "built in the same graph (or tf.function) as ys."
            )
        tensors.append(entry)
    return tensors


def _usable(view: ForwardView, candidates: list[tf.Tensor]) -> list[tf.Tensor]:
    """The candidates made by recomputable ops of the view; each other one is logged."""
    usable = {}
    for tensor in candidates:
        if tensor.ref() in usable:
            continue
        if tensor.op in view.recomputable:
            usable[tensor.ref()] = tensor
        elif tensor.op not in view.position:
            logger.warning("Ignoring checkpoint %s: it is not between xs and ys.", tensor.name)
        else:
            logger.warning(
                "Ignoring checkpoint %s: its op is never recomputed, so it is kept anyway.",
                tensor.name,
            )
    return list(usable.values())
