"""The forward graph between xs and ys, as checkpointing (and a user's strategy) sees it.

Only the ops that lie on a path from some x to some y matter: ops outside it receive no
gradient, so they are never recomputed. Of those ops, some must not be recomputed either,
because running them a second time would give another result (random ops, variable reads,
iterators) or is not possible piecemeal (TF1 control-flow frames). Their outputs are used as
they were computed in the forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from functools import cached_property

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import costs, kernels, queries
from memory_saving_gradients._src.analysis.measured import MeasuredCosts, OpMeasurement

logger = logging.getLogger(__name__)

#: Stateless op types whose value may be overridden at run time (fed), so a copy could differ.
FEEDABLE_TYPES = frozenset({"PlaceholderWithDefault"})
#: TF1 control-flow primitives: a frame's ops only run correctly together, so none is copied,
#: not even a cond's Merge, which lies outside the frame it closes.
FRAME_TYPES = frozenset(
    {
        "Enter", "Exit", "LoopCond", "Merge", "NextIteration", "RefEnter", "RefExit",
        "RefMerge", "RefNextIteration", "RefSwitch", "Switch",
    }
)  # fmt: skip


#: Ops whose output is a variable's value: the gradient of that output is the variable's.
VARIABLE_READS = frozenset({"ReadVariableOp", "Identity", "Snapshot"})


#: Why a loop, cond or nested tf.function whose only stateful ops are variable reads is kept.
READS_VARIABLES_INSIDE = (
    "it reads variables inside the functions it runs (a tf.while_loop body, tf.cond branches, "
    "a nested tf.function), which makes it stateful: pass their values in as tensors "
    "(tf.convert_to_tensor(variable) outside it) to let it be recomputed"
)


def why_not_recomputable(op: tf.Operation, xs_ops: frozenset[tf.Operation]) -> str | None:
    """The reason `op` must not be copied into the backward pass, or None if it may be."""
    if op in xs_ops:
        return "it produces one of xs"
    if _tf.is_stateful(op):
        if _tf.stateful_through_variable_reads(op):
            return READS_VARIABLES_INSIDE
        return "it is stateful (random, variable access, I/O), so a rerun could differ"
    if _tf.in_v1_control_flow(op) or op.type in FRAME_TYPES:
        return "it belongs to a TF1 control-flow frame"
    if op.type in FEEDABLE_TYPES:
        return f"{op.type} can be fed at run time"
    if any(t.dtype != t.dtype.base_dtype for t in op.inputs):
        return "it reads a reference variable, which may change before the backward pass"
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardView:
    """The ops between xs and ys, which of them may be recomputed, and what must be kept:
    what a checkpointing policy is given to choose its checkpoints from (the strategies,
    budgets and a user's own callable alike).

    Attributes:
      ys, xs: the differentiated tensors and the tensors differentiated against.
      ops: every op on a path from an x to a y, in topological order.
      recomputable: the ops of `ops` that a backward pass may run again.
      must_keep: outputs of recomputable ops that non-recomputable ops read. Gradients flow
        into the non-recomputable op as it ran, so these tensors are always kept.
      reused: outputs of non-recomputable ops that recomputable ops read: recomputed copies
        read them as they were computed.
      given_grad_ys: whether backprop starts from given gradients of the ys rather than
        ones (which graph optimizers fold into constants).
      gradients_held: whether the gradients of xs all live to the end of the step (they are
        fetched or returned, or checked together before any is applied: loss scaling,
        global-norm clipping), rather than each being applied, and freed, once complete.
      update_scratch: the bytes the update applying one x's gradient holds beside it while it
        runs, over the gradient's bytes (an optimizer's temporaries: Adam's two); counted
        where each gradient is applied once complete.
      measured: a profiled plain step of these ops (`profiling.measure_costs`), whose
        kernels' scratch and times replace the static estimates; None for static costs.
      enclosing: the view this one is a segment of (a nested step's), whose ops' costs it
        reuses where their gradients need the same inputs here; None for a whole step.
    """

    ys: tuple[tf.Tensor, ...]
    xs: tuple[tf.Tensor, ...]
    ops: tuple[tf.Operation, ...]
    recomputable: frozenset[tf.Operation]
    must_keep: tuple[tf.Tensor, ...]
    reused: tuple[tf.Tensor, ...]
    given_grad_ys: bool = False
    gradients_held: bool = False
    update_scratch: float = 0.0
    measured: MeasuredCosts | None = None
    enclosing: ForwardView | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        ys: Sequence[tf.Tensor],
        xs: Sequence[tf.Tensor],
        given_grad_ys: bool = False,
        gradients_held: bool = False,
        through_xs: bool = True,
        update_scratch: float = 0.0,
        measured: MeasuredCosts | None = None,
        enclosing: ForwardView | None = None,
    ) -> ForwardView:
        """Analyse the graph between `xs` and `ys` (tensors of one graph).

        Like `tf.gradients`, the view holds the ops on paths from one x through another to
        the ys. A segment's view, whose xs are the boundaries it is recomputed from, passes
        `through_xs=False`: nothing behind its boundaries is recomputed with it, and the walk
        then stays inside the segment rather than crossing the whole graph.
        """
        xs_refs = {x.ref() for x in xs}
        reaching_ys = queries.backward_ops(
            (y.op for y in ys), stop_at=None if through_xs else (lambda t: t.ref() in xs_refs)
        )
        between = queries.forward_ops(xs, within=reaching_ys)
        ordered = queries.topological_order(between)
        xs_ops = frozenset(x.op for x in xs)
        recomputable = set()
        for op in ordered:
            reason = why_not_recomputable(op, xs_ops)
            if reason is None:
                recomputable.add(op)
            else:
                logger.debug("Not recomputing %s (%s): %s.", op.name, op.type, reason)
        must_keep = {
            t.ref(): t
            for op in ordered
            if op not in recomputable
            for t in op.inputs
            if t.op in recomputable
        }
        reused = {
            t.ref(): t
            for op in ordered
            if op in recomputable
            for t in op.inputs
            if t.op not in recomputable and (t.op in between or t.ref() in xs_refs)
        }
        return cls(
            ys=tuple(ys),
            xs=tuple(xs),
            ops=tuple(ordered),
            recomputable=frozenset(recomputable),
            must_keep=tuple(must_keep.values()),
            reused=tuple(reused.values()),
            given_grad_ys=given_grad_ys,
            gradients_held=gradients_held,
            update_scratch=update_scratch,
            measured=measured,
            enclosing=enclosing,
        )

    @cached_property
    def kept_for_variable_reads(self) -> tuple[tf.Operation, ...]:
        """Ops kept only because functions they run read variables (`READS_VARIABLES_INSIDE`):
        the user can let them be recomputed."""
        return tuple(
            op
            for op in self.ops
            if op not in self.recomputable
            and _tf.is_stateful(op)
            and _tf.stateful_through_variable_reads(op)
        )

    @cached_property
    def costs(self) -> dict[tf.Operation, costs.OpCost]:
        """What each op costs (`costs.op_cost`), its gradient taken for what lies between xs
        and ys. A segment's view takes the enclosing view's cost of an op whose gradient
        needs the same inputs (the nested plans of a 1000-block MLP build about a hundred
        segment views)."""
        xs = {x.ref() for x in self.xs}

        def needs_gradient(tensor: tf.Tensor) -> bool:
            return tensor.op in self.position or tensor.ref() in xs

        known = self.enclosing.costs if self.enclosing is not None else {}

        def cost_of(op: tf.Operation) -> costs.OpCost:
            cost = known.get(op)
            if cost is not None and cost.needed == costs.needed_inputs(op, needs_gradient):
                return cost
            return costs.op_cost(op, needs_gradient)

        static = {op: cost_of(op) for op in self.ops}
        if self.measured is None:
            return static
        found = self.measured.for_ops(op.name for op in self.ops)
        _check_measured_here(self.ops, found)
        return {op: costs.measured_cost(cost, found.get(op.name)) for op, cost in static.items()}

    @cached_property
    def weight_ops(self) -> frozenset[tf.Operation]:
        """The recomputable ops computed from variables' values and constants alone (a kernel
        cast to half precision, a transposed weight). Nothing but the variables holds them
        back, so the executor runs them as a step starts (NOTE [weight ops wait for their
        readers] in `execution.py`)."""
        found: set[tf.Operation] = set()
        for op in self.ops:
            if (
                op in self.recomputable
                and op.inputs
                and all(t.op in found or is_weight_value(t) for t in op.inputs)
            ):
                found.add(op)
        return frozenset(found)

    def is_weight(self, tensor: tf.Tensor) -> bool:
        """Whether `tensor` is there, or computable, before a step starts: a variable's
        value, a constant, or an output of `weight_ops`."""
        return is_weight_value(tensor) or tensor.op in self.weight_ops

    @cached_property
    def _x_refs(self) -> frozenset:
        return frozenset(x.ref() for x in self.xs)

    def is_x(self, tensor: tf.Tensor) -> bool:
        """Whether `tensor` is one of `xs`."""
        return tensor.ref() in self._x_refs

    def bytes(self, tensor: tf.Tensor) -> int:
        """Bytes `tensor` occupies by its static shape (`kernels.tensor_bytes`)."""
        return kernels.tensor_bytes(tensor)

    @cached_property
    def position(self) -> dict[tf.Operation, int]:
        """Index of each op in `ops`: sorting by it gives a topological order."""
        return {op: i for i, op in enumerate(self.ops)}

    def order(self, op: tf.Operation) -> int:
        """A sort key giving a topological order of the view's ops and the xs' own ops (which
        come first)."""
        return self.position.get(op, -1)

    def consumers(self, tensor: tf.Tensor) -> list[tf.Operation]:
        """The ops of this view that read `tensor`."""
        return [op for op in tensor.consumers() if op in self.position]


def is_weight_value(tensor: tf.Tensor) -> bool:
    """Whether `tensor` is a variable's value or a constant: there before a step starts."""
    op = tensor.op
    if op.type == "Const":
        return True
    return op.type in VARIABLE_READS and any(
        t.dtype == tf.resource or t.dtype != t.dtype.base_dtype for t in op.inputs
    )


#: Below this fraction of a view's kernels found in a profile, it was likely of another graph.
MEASURED_COVERAGE = 0.5


def _check_measured_here(ops: Sequence[tf.Operation], found: dict[str, OpMeasurement]) -> None:
    """Raise where a profile shows none of `ops`, warn where it shows few of those that run
    kernels: plans match a profile to their ops by name."""
    running = [op for op in ops if op.type not in kernels.ALIASING | kernels.RESIDENT]
    matched = sum(op.name in found for op in running)
    if running and not matched:
        raise ValueError(
            f"The measured costs show none of the {len(running)} forward ops being planned "
            f"(first: {running[0].name!r}): they were measured on another step. Measure the "
            "plain step of this model, built the same way, with measure_costs."
        )
    if matched < MEASURED_COVERAGE * len(running):
        logger.warning(
            "The measured costs show only %d of the %d forward ops being planned (by name); "
            "the others are planned as costing nothing. Was the step measured built the same "
            "way?", matched, len(running),
        )  # fmt: skip
