"""`Plan`: what checkpointed backprop keeps, and what that is predicted to cost.

A plan is made for one forward graph (one set of ys and xs) by a strategy, and can be looked
at before any gradient is built: the tensors kept, the predicted activation peak with them
and without them (`simulation`), and the forward compute backprop repeats. Passed back as
`checkpoints=plan`, it is used as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import tensorflow as tf

from memory_saving_gradients._src.analysis import costs, kernels, queries
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning import simulation
from memory_saving_gradients._src.planning.schedule import Schedule, Segment

MIB = 2**20


class Plan:
    """The tensors checkpointed backprop keeps for one forward graph, and their predicted cost.

    Attributes:
      checkpoints: the tensors kept from the forward pass.
      nested: for nested recomputation, the tensors kept while the segment around them is
        recomputed, one tuple per level, outermost first; empty for one level.
      saved: tensors kept inside segments (selective recomputation): their ops are not run
        again, the cheap ops around them are; they cut nothing (`schedule`).
      remade: masks made outside the forward graph (dropout's, drawn by stateless random
        ops) that backprop draws again where it recomputes their readers, rather than hold
        them from the forward pass (NOTE [masks made again] in analysis/execution.py); made
        again only by plans that `remake_outside` ('memory's on a GPU, `remaking_outside`).
      strategy: what chose them.
      peak_bytes: the predicted activation peak of a step with this plan (bytes above what is
        resident before it: variables, inputs).
      plain_peak_bytes: the same for `tf.gradients`.
      fallback_peak_bytes: the same for the plain gradients `gradients` computes where the
        plan does not pay (`pays`): below `plain_peak_bytes` where TensorFlow's optimizers
        move products of `tf.gradients` into the forward pass, which `gradients` keeps in
        their order, and where its own gradient functions hold less (`gradient_functions`).
      step_peak_bytes: the predicted peak of the step `gradients` builds with this plan:
        `peak_bytes` where it pays, else `fallback_peak_bytes`.
      recompute_flops_fraction: the forward compute backprop repeats, over the forward
        pass's (0: nothing recomputed; about 1 for one level over the whole pass): FLOPs by
        the static model, or kernel time where the costs are measured.
      cost_source: what the predictions come from: "measured" (a profiled plain step,
        `measure_costs`) or "static" (estimates from shapes and op types).
      time_ratio: the predicted step time over plain backprop's, with measured costs (the
        measured kernel time recomputed copies add); None with static costs.
    """

    def __init__(
        self,
        view: ForwardView,
        levels: Sequence[Sequence[tf.Tensor]],
        strategy: str,
        plain_peak_bytes: int | None = None,
        saved: Sequence[tf.Tensor] = (),
        remake_outside: bool = False,
    ) -> None:
        self._view = view
        self.remake_outside = remake_outside
        self.checkpoints: tuple[tf.Tensor, ...] = tuple(levels[0]) if levels else ()
        self.nested: tuple[tuple[tf.Tensor, ...], ...] = tuple(
            tuple(level) for level in levels[1:] if level
        )
        self.saved: tuple[tf.Tensor, ...] = tuple(saved)
        self.strategy = strategy
        if plain_peak_bytes is not None:  # already simulated for this view
            self.__dict__["plain_peak_bytes"] = plain_peak_bytes

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The schedule of backprop keeping `checkpoints`, with `nested` inside its steps."""
        return Schedule.build(
            self._view, self.checkpoints, self.nested, self.saved, self.remake_outside
        )

    def schedule_on(self, view: ForwardView) -> Schedule:
        """The schedule of this plan on `view`, a view of the ys and xs it was made for (the
        xs perhaps in another order, for which gradients come in that order)."""
        if view is self._view:
            return self.schedule
        return Schedule.build(view, self.checkpoints, self.nested, self.saved, self.remake_outside)

    @property
    def remade(self) -> tuple[tf.Tensor, ...]:
        return tuple(self.schedule.remade.values())

    def remaking_outside(self) -> Plan:
        """This plan, drawing again the masks made outside the forward graph that only its
        recomputed ops read (`remade`): a step holds none of them from the forward pass, for
        the time their draws take again."""
        if self.remake_outside:
            return self
        return Plan(
            self._view,
            self.levels,
            self.strategy,
            self.plain_peak_bytes,
            self.saved,
            remake_outside=True,
        )

    @property
    def levels(self) -> tuple[tuple[tf.Tensor, ...], ...]:
        """`checkpoints` then each level of `nested`."""
        return (self.checkpoints, *self.nested)

    def made_for(self, view: ForwardView) -> bool:
        """Whether this plan was made for the ys and xs of `view`."""
        mine = self._view
        return [t.ref() for t in mine.ys] == [t.ref() for t in view.ys] and {
            t.ref() for t in mine.xs
        } == {t.ref() for t in view.xs}

    @functools.cached_property
    def peak_bytes(self) -> int:
        if not self.checkpoints:
            return self.fallback_peak_bytes
        peak = simulation.checkpointed_peak(self.schedule)
        assert peak is not None  # no limit
        return peak

    def peak_within(self, limit: float) -> bool:
        """Whether the predicted peak is at most `limit` bytes. The step is simulated only
        until its peak passes `limit` (searches try many plans that do not fit); where it
        does not, `peak_bytes` is kept."""
        if "peak_bytes" not in self.__dict__ and self.checkpoints:
            peak = simulation.checkpointed_peak(self.schedule, limit)
            if peak is None:
                return False
            self.__dict__["peak_bytes"] = peak
        return self.peak_bytes <= limit

    @functools.cached_property
    def plain_peak_bytes(self) -> int:
        return simulation.plain_peak(self._view)

    @functools.cached_property
    def fallback_peak_bytes(self) -> int:
        return simulation.plain_peak(self._view, as_rewritten=True)

    @property
    def step_peak_bytes(self) -> int:
        return self.peak_bytes if self.pays else self.fallback_peak_bytes

    def predicted(self) -> Plan:
        """This plan with its predictions made now, of the graph as it is: gradients built
        later (TensorFlow's, of function calls and control flow) add outputs to forward ops,
        which would change predictions made after them."""
        predictions = (
            "peak_bytes",
            "plain_peak_bytes",
            "fallback_peak_bytes",
            "recompute_flops_fraction",
            "pays",
        )
        for prediction in (*predictions, "time_ratio"):
            getattr(self, prediction)
        return self

    @functools.cached_property
    def pays(self) -> bool:
        """Whether backprop with this plan recomputes something and is predicted to need less
        memory than plain backprop as `gradients` computes it; where not, `gradients`
        computes plain gradients."""
        return self.recomputes and self.peak_bytes < self.fallback_peak_bytes

    @functools.cached_property
    def recomputes(self) -> bool:
        """Whether backprop with this plan runs any forward op again."""
        return bool(self.checkpoints) and _runs_again(self.schedule)

    @property
    def cost_source(self) -> str:
        return "static" if self._view.measured is None else "measured"

    @functools.cached_property
    def time_ratio(self) -> float | None:
        measured = self._view.measured
        if measured is None or not measured.kernel_seconds:
            return None
        if not self.checkpoints:
            return 1.0
        return 1.0 + _recomputed(self.schedule, self._view.costs) / measured.kernel_seconds

    @functools.cached_property
    def recompute_flops_fraction(self) -> float:
        cost = self._view.costs
        forward = sum(cost[op].compute for op in self._view.ops)
        if not self.checkpoints or not forward:
            return 0.0
        return _recomputed(self.schedule, cost) / forward

    def _costs_line(self) -> str:
        measured = self._view.measured
        if measured is None:
            return "static estimates (pass costs=measure_costs(plain step) to plan from measured)"
        return (
            f"measured on a plain step ({measured.peak_bytes / MIB:.1f} MiB measured peak); "
            f"predicted step time {self.time_ratio:.2f}x plain"
        )

    def __repr__(self) -> str:
        nested = f", nested {[len(level) for level in self.nested]}" if self.nested else ""
        saved = f", {len(self.saved)} saved inside" if self.saved else ""
        return (
            f"<Plan {self.strategy}: {len(self.checkpoints)} checkpoints{nested}{saved}, "
            f"peak {self.peak_bytes / MIB:.1f} MiB (plain {self.plain_peak_bytes / MIB:.1f})>"
        )

    def __str__(self) -> str:
        plain, peak = self.plain_peak_bytes, self.peak_bytes
        lines = [
            f"Plan ({self.strategy}): keeps {_count(self.checkpoints)}"
            + (f", and {sum(map(len, self.nested))} more nested" if self.nested else "")
            + (
                f", and {len(self.schedule.saved)} inside segments, whose ops are not recomputed"
                if self.schedule.saved
                else ""
            ),
            f"  predicted activation peak {peak / MIB:.1f} MiB with it, "
            f"{plain / MIB:.1f} MiB without ({peak / plain if plain else 1:.2f} of plain)",
            f"  recomputes {self.recompute_flops_fraction:.2f} of the forward compute",
            *(
                [f"  draws {_count(self.remade)} again: masks made outside the forward graph"]
                if self.checkpoints and self.remade
                else []
            ),
            f"  costs: {self._costs_line()}",
        ]
        if self.checkpoints and not self.pays:
            lines.append("  saves nothing: gradients() computes plain gradients for it")
        rows = [
            (str(depth), t.name, t.op.type, _shape(t), f"{kernels.tensor_bytes(t) / MIB:.2f}")
            for depth, level in enumerate(self.levels)
            for t in level
        ]
        if rows:
            header = ("level", "tensor", "op", "shape", "MiB")
            widths = [max(len(row[i]) for row in [header, *rows]) for i in range(5)]
            for row in [header, *rows]:
                cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
                cells[-1] = row[-1].rjust(widths[-1])
                lines.append("  " + "  ".join(cells).rstrip())
        return "\n".join(lines)


def _runs_again(schedule: Schedule) -> bool:
    return any(
        _run_again(schedule.view, step.segment)
        or (step.inner is not None and _runs_again(step.inner))
        for step in schedule.steps
    )


def _recomputed(schedule: Schedule, cost: dict[tf.Operation, costs.OpCost]) -> float:
    """The forward compute backprop with `schedule` repeats, by the `cost` of each op: every
    step recomputes its segment, and a step with an inner schedule recomputes that one's
    segments again."""
    total = 0.0
    for step in schedule.steps:
        total += sum(cost[op].compute for op in _run_again(schedule.view, step.segment))
        total += _remaking(schedule, step.segment)
        if step.inner is not None:
            total += _recomputed(step.inner, cost)
    return total


def _remaking(schedule: Schedule, segment: Segment) -> float:
    """The compute of drawing again the masks `segment`'s copies read (`Schedule.remade`):
    FLOPs, or the kernel seconds measured for the ops that drew them in the plain step."""
    ops = schedule.drawing_again(segment)
    measured = schedule.view.measured
    if measured is None:
        return sum(costs.flops(op) for op in ops)
    return sum(measured.kernels[op.name].seconds for op in ops if op.name in measured.kernels)


def _run_again(view: ForwardView, segment: Segment) -> list[tf.Operation]:
    """The copies of the segment's ops that run: those with an output that their own
    gradient, the gradient of another of its ops, or another running copy reads. The
    executor prunes the rest (the copy of a convolution making a boundary: its gradient reads
    only its inputs); the ops of tensors saved inside it never run (they are read as saved)."""
    running: set[tf.Operation] = set()
    ops = segment.ops
    for op in sorted(segment.rerun, key=view.position.__getitem__, reverse=True):
        read = bool(view.costs[op].saved_outputs) or any(
            reader in running
            or (reader in ops and index in view.costs[reader].saved_inputs and input_ is tensor)
            for tensor in op.outputs
            for reader in view.consumers(tensor)
            for index, input_ in enumerate(reader.inputs)
        )
        if read:
            running.add(op)
    return list(running)


def _count(tensors: Sequence[tf.Tensor]) -> str:
    return f"{len(tensors)} tensor" + ("" if len(tensors) == 1 else "s")


def _shape(tensor: tf.Tensor) -> str:
    shape = queries.static_shape(tensor)
    if shape is None:
        return "?"
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
