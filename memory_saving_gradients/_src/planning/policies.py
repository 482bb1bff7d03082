"""Checkpoint policies: which forward tensors backprop keeps, as `checkpoints=` chooses.

`checkpoints` names a strategy, or is a `MemoryBudget`, a `Plan`, a list of tensors, or a
strategy of one's own: any callable that takes a `ForwardView` (the read-only description of
the forward graph between xs and ys: its ops in order, which may be recomputed, tensor sizes
and op costs) and returns the tensors to keep, or a `Plan`, like a JAX checkpoint policy:

    def keep_attention_outputs(view):
        return [op.outputs[0] for op in view.ops if "attention_output" in op.name]

    msg.gradients(loss, variables, checkpoints=keep_attention_outputs)

The named ones (`STRATEGIES`): 'collection' keeps what `add_checkpoint` marked, 'speed' the
outputs of matmuls and convolutions, 'memory' what gives the least predicted peak, 'balanced'
most of that saving for less recomputation. `plan_for` turns any `checkpoints` argument into
a Plan: it keeps the returned tensors that can serve (made by a recomputable op between xs and
ys), logs the others with the reason, and raises a clear error when nothing usable is left.
How the plans of 'memory', 'balanced' and budgets are found is `search`'s business.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TypeAlias

import tensorflow as tf

from memory_saving_gradients._src.analysis import kernels
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView, why_not_recomputable
from memory_saving_gradients._src.planning import saving, search, simulation
from memory_saving_gradients._src.planning.plans import Plan
from memory_saving_gradients._src.planning.schedule import recomputed_repeatedly, saveable

logger = logging.getLogger(__name__)

#: A checkpoint policy of one's own: given the forward graph, the tensors to keep or a Plan.
Strategy: TypeAlias = Callable[[ForwardView], Sequence[tf.Tensor] | Plan]
#: What users pass as `checkpoints`: a strategy's name, a strategy (a `MemoryBudget`, one's
#: own), a Plan, or tensors and tensor names.
CheckpointsArg: TypeAlias = str | Plan | Strategy | Sequence[tf.Tensor | str]

#: Name of the graph collection read by the 'collection' strategy.
CHECKPOINTS_COLLECTION = "checkpoints"


_COLLECTION_ADVICE = (
    "add tensors with memory_saving_gradients.add_checkpoint(t), "
    "or use checkpoints='memory' to choose them automatically"
)
_SPEED_ADVICE = (
    "the forward pass has no matmul or convolution to keep; "
    "use checkpoints='memory' or pass a list of tensors"
)
_LIST_ADVICE = "pass tensors computed from xs on the way to ys, or use checkpoints='memory'"
#: What plans of a list of tensors are called.
_LIST_LABEL = "the checkpoint list"


class NoCheckpointsError(ValueError):
    """No usable checkpoint between xs and ys; the message says what to try instead."""

    # AutoGraph re-raises an error from a converted tf.function's code as its own type only
    # where it can rebuild it from a message, which it knows by this `__init__`; any other
    # reaches the caller as a StagingError, which `except NoCheckpointsError` misses.
    __init__ = Exception.__init__


def add_checkpoint(tensor: tf.Tensor) -> tf.Tensor:
    """Add `tensor` to its graph's 'checkpoints' collection and return it, for inline use."""
    tensor.graph.add_to_collection(CHECKPOINTS_COLLECTION, tensor)
    return tensor


def collection(view: ForwardView, label: str) -> Plan:
    """The tensors added to the 'checkpoints' collection of the graph."""
    tensors = view.ys[0].graph.get_collection(CHECKPOINTS_COLLECTION)
    return _kept(view, tensors, label, _COLLECTION_ADVICE)


def speed(view: ForwardView, label: str) -> Plan:
    """Outputs of matmuls and convolutions with weights, saved inside segments or kept as
    checkpoints: only what is cheap to remake per byte is recomputed, each op once. Of two
    such plans, the one with the smaller predicted peak:

    - the outputs of matmuls and convolutions with weights saved inside segments
      (selective recomputation), and what costs as much to remake per byte (the statistics
      of batch normalisations), with one level of cuts, the one with the least predicted
      peak, deciding which cheap ops are recomputed together;
    - those outputs, and those of function calls running a matmul or convolution, kept as
      checkpoints, and where a path escapes them (the skip path of a residual network), the
      last ops of that path too, since every segment behind it would recompute it.

    The first saves more where normalisations and activations hold most of the memory (conv
    nets), and is tried only where every expensive output can be saved inside a segment.

    A product of two activations (attention's scores, query times key) is as cheap to remake
    per byte as its operands are small: a transformer's scores take 2 * head_dim FLOPs an
    element where its projections take 2 * model_dim, and grow with the square of the
    sequence. So, as Megatron-LM's selective recomputation and JAX's
    `dots_with_no_batch_dims_saveable` do, it is recomputed (with the softmax and dropout
    after it) unless it costs as much per byte as the cheapest product with a weight, and
    what is saved is moved up to its operands (`saving.speed_saved`).
    """
    expensive = _usable(
        view,
        [
            out
            for op in saving.expensive_ops(view)
            if op in view.recomputable
            for out in op.outputs
        ],
    )
    if not expensive:
        raise _nothing_kept(label, _speed_advice(view))
    kept = expensive
    while repeated := recomputed_repeatedly(view, kept):
        ends = [
            out
            for op in repeated
            for out in op.outputs
            if any(reader not in repeated for reader in view.consumers(out))
        ]
        kept = list({t.ref(): t for t in (*kept, *ends)}.values())
    plans = [Plan(view, [kept], label)]
    if all(saveable(view, t) for t in expensive):  # else some would be recomputed
        selective = search.least_peak_saving(view, saving.speed_saved(view), label)
        if selective.checkpoints:  # cuts of a chain's matmuls and tanhs save nothing
            plans.append(selective)
    best = min(plans, key=lambda plan: (plan.peak_bytes, plan.recompute_flops_fraction))
    return search.as_it_ran_first(best)


def _speed_advice(view: ForwardView) -> str:
    """What to do where 'speed' finds nothing to keep: where the matmuls and convolutions are
    all ops never recomputed (kept anyway), which they are and why (`why_not_recomputable`:
    for a loop reading variables, how to let it be recomputed)."""
    kept = [op for op in view.ops if op not in view.recomputable and saving.is_contraction(op)]
    if not kept:
        return _SPEED_ADVICE
    reason = why_not_recomputable(kept[0], frozenset(x.op for x in view.xs))
    return (
        f"its matmuls and convolutions are never recomputed, so they are kept anyway (e.g. "
        f"{[op.name for op in kept[:3]]}: {reason}); use checkpoints='memory' or pass a list "
        f"of tensors"
    )


def memory(view: ForwardView, label: str) -> Plan:
    """The least predicted peak. One level of cuts recomputes each op once and holds about
    sqrt(2N) tensors on an N-layer chain; nested cuts (segments checkpointed in turn) hold
    fewer, down to O(log N), for about one more forward pass a level. Of the plans whose
    predicted peak is within `NESTING_GAIN` of the least, the one recomputing least is used.

    When no cuts lower the peak (tiny graphs), none are kept and gradients are computed as
    `tf.gradients` does, which is logged. On a GPU, dropout masks drawn outside the forward
    graph are drawn again where their readers are recomputed (`Plan.remade`), where that
    lowers the predicted peak: each is drawn beside its readers through a tensor of four
    bytes an element, which outweighs holding few masks. On a CPU they are held
    (`Plan.remaking_outside` draws them again there too).
    """
    plan = search.as_it_ran_first(search.least_peak(view, label))
    if not _draws_again(view):
        return plan
    remaking = plan.remaking_outside()
    return remaking if remaking.remade and remaking.peak_bytes < plan.peak_bytes else plan


def _draws_again(view: ForwardView) -> bool:
    """Whether 'memory' weighs drawing masks again (`Plan.remaking_outside`): where `view`
    reads some that can be, and no CPU kernel draws them. A CPU's draw costs a pass of its
    generator per element, more than the element-wise ops around it (docs/guide/strategies.md
    has the measured cost); a GPU's costs about what one of those ops does."""
    remakeable = execution_of(view).remakeable
    return bool(remakeable) and not any(
        kernels.runs_cpu_kernels(op) for ops in remakeable.values() for op in ops
    )


def balanced(view: ForwardView, label: str) -> Plan:
    """The plan recomputing least whose predicted peak is one level's least plus a third of
    what that saves: most of the savings for less recomputation (the longest final part of
    the forward pass that fits is not recomputed at all)."""
    plain = simulation.plain_peak(view)
    least = search.one_level_least_peak(view, plain)
    return search.as_it_ran_first(
        search.within_budget(
            view, least + (plain - least) / 3, plain, label, saveable=saving.saveable_sets(view)
        )
    )


@dataclasses.dataclass(frozen=True, repr=False)
class NamedStrategy:
    """A built-in strategy, picked by its name: `checkpoints='memory'`. Called with a view,
    it gives `choose`'s plan, which plans, logs and tables call by `label`."""

    name: str
    choose: Callable[[ForwardView, str], Plan]

    @property
    def label(self) -> str:
        """The name as the argument is written, quotes included: 'memory'."""
        return repr(self.name)

    def __call__(self, view: ForwardView) -> Plan:
        return self.choose(view, self.label)

    def __repr__(self) -> str:
        return self.label


#: The strategies `checkpoints` may name.
STRATEGIES: dict[str, NamedStrategy] = {
    strategy.name: strategy
    for strategy in (
        NamedStrategy("collection", collection),
        NamedStrategy("speed", speed),
        NamedStrategy("memory", memory),
        NamedStrategy("balanced", balanced),
    )
}


@dataclasses.dataclass(frozen=True, repr=False)
class MemoryBudget:
    """The checkpoints that recompute least while the predicted activation peak of a step
    stays within a budget: `fraction` of plain backprop's predicted peak, or `bytes`.

    One level of cuts reaches its least peak by recomputing nearly the whole forward pass. A
    budget above that spends memory on speed: backprop runs on the original activations of
    the longest final part of the forward pass that fits, and only the part before it is
    recomputed. A budget below it nests recomputation: segments are themselves checkpointed
    and their inner parts recomputed once more, each level costing about one more forward
    pass (on chains, down to O(log n) activations; 'memory' takes the least of those). Pass
    it wherever `checkpoints` is accepted, e.g. `checkpoints=MemoryBudget(0.25)` or
    `MemoryBudget(bytes=12 * 2**30)`. Plans keep the largest recomputed tensor free beside
    the budget (`search.budget_headroom`). At a budget no plan fits, the plan of
    checkpoints='memory' is used and its peak is logged; at or above plain backprop's peak
    (`bytes=` only) nothing is recomputed.
    """

    fraction: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError(
                "MemoryBudget takes either a fraction of plain backprop's peak (e.g. "
                "MemoryBudget(0.4)) or a number of bytes (MemoryBudget(bytes=2**30)), got "
                f"fraction={self.fraction!r}, bytes={self.bytes!r}."
            )
        if self.fraction is not None and not (_is_number(self.fraction) and 0 < self.fraction < 1):
            raise ValueError(
                f"MemoryBudget fraction {self.fraction!r} is not between 0 and 1: pass the "
                "share of plain backprop's peak to keep (MemoryBudget(0.4) for 40%), or a "
                "number of bytes (MemoryBudget(bytes=2**30))."
            )
        if self.bytes is not None and not (_is_number(self.bytes) and self.bytes > 0):
            raise ValueError(
                f"MemoryBudget bytes={self.bytes!r} is not a positive number of bytes "
                "(e.g. MemoryBudget(bytes=2**30) for 1 GiB)."
            )

    def __repr__(self) -> str:
        if self.bytes is not None:
            return f"MemoryBudget(bytes={self.bytes})"
        return f"MemoryBudget({self.fraction:.3g})"

    def __call__(self, view: ForwardView) -> Plan:
        plain = simulation.plain_peak(view)
        if self.bytes is not None:
            budget: float = self.bytes
        else:
            assert self.fraction is not None  # __post_init__ checks that one is given
            budget = self.fraction * plain
        return search.as_it_ran_first(
            search.within_budget(
                view,
                budget,
                plain,
                repr(self),
                search.budget_headroom(view),
                saveable=saving.saveable_sets(view),
            )
        )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def plan_for(view: ForwardView, checkpoints: CheckpointsArg) -> Plan:
    """The plan for `view` from a strategy name or callable, a Plan, or a list of tensors or
    tensor names.

    Raises:
      ValueError: `checkpoints` names no strategy, or is a Plan made for other ys or xs.
      TypeError: a list entry is not a tensor or tensor name of the graph of ys.
      NoCheckpointsError: nothing usable remains, except where a plan chose to keep nothing
        ('memory', 'balanced', budgets): gradients are then plain.
    """
    if isinstance(checkpoints, Plan):
        if not checkpoints.made_for(view):
            raise ValueError(
                f"{checkpoints!r} was made for other ys or xs: make the plan with "
                "memory_saving_gradients.plan for the same ys and xs."
            )
        return checkpoints
    check_checkpoints(checkpoints)
    if isinstance(checkpoints, str):
        return STRATEGIES[checkpoints](view)
    if not callable(checkpoints):
        return _kept(view, checkpoints, _LIST_LABEL, _LIST_ADVICE)
    result = checkpoints(view)
    if isinstance(result, Plan):
        return result
    return _kept(view, result, _label_of(checkpoints), _LIST_ADVICE)


def check_checkpoints(checkpoints: CheckpointsArg) -> None:
    """Fail early where `checkpoints` can be no `checkpoints` argument: an unknown strategy
    name, or neither a Plan, a callable nor a list (whose entries need the graph to check).

    Raises:
      ValueError: an unknown strategy name.
      TypeError: any other value of the wrong kind.
    """
    if isinstance(checkpoints, str):
        if checkpoints not in STRATEGIES:
            raise ValueError(
                f"Unknown checkpoint strategy {checkpoints!r}: use one of "
                f"{sorted(STRATEGIES)}, a MemoryBudget, a callable or a list of tensors."
            )
    elif isinstance(checkpoints, type):
        raise TypeError(
            f"checkpoints={checkpoints.__name__} is a class: pass an instance of it, e.g. "
            "MemoryBudget(0.4)."
        )
    elif not (isinstance(checkpoints, Plan | Sequence) or callable(checkpoints)):
        raise TypeError(
            f"checkpoints must be a strategy name, a MemoryBudget, a Plan, a callable or a "
            f"list of tensors, got {checkpoints!r}."
        )


def _label_of(strategy: Callable) -> str:
    return getattr(strategy, "__name__", None) or repr(strategy)


def _kept(view: ForwardView, entries, label: str, advice: str) -> Plan:
    """The one-level plan keeping those of `entries` that can serve, called `label`; where
    none can, NoCheckpointsError with `advice`."""
    usable = _usable(view, _as_tensors(view, entries))
    if not usable:
        raise _nothing_kept(label, advice)
    return Plan(view, [usable], label)


def _nothing_kept(label: str, advice: str) -> NoCheckpointsError:
    source = label if label == _LIST_LABEL else f"checkpoints={label}"
    return NoCheckpointsError(
        f"{source} gave no tensor between xs and ys that can be recomputed from: {advice}."
    )


def _as_tensors(view: ForwardView, entries) -> list[tf.Tensor]:
    """Resolve a checkpoint list into tensors of the graph of ys, or raise TypeError."""
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise TypeError(
            f"checkpoints must be a strategy name, a MemoryBudget, a Plan, a callable or a "
            f"list of tensors, got {entries!r}."
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
