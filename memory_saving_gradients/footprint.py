"""The memory a training step needs, simulated: bytes alive as the executor runs it.

A step is simulated op by op, forward in the view's topological order, then backward in
reverse, the way TensorFlow's executor runs a backward pass the gates order. An op's outputs
are allocated while its inputs are still alive; then every buffer no tensor needs any more is
freed. Tensors share buffers where TensorFlow's kernels share them: reshapes and identities
alias their input, element-wise kernels write into an input buffer nothing else needs
(`costs.REUSES_INPUT_BUFFER`), and gradients passed on unchanged (an Add's) alias. Backprop
keeps what each gradient reads (`costs.OpCost`) until that gradient has run, and a gradient
function's own temporaries (`OpCost.workspace`) live while it runs; the gradient parts of one
tensor live until they are summed, when its producer is differentiated. Gradients of xs live
to the end of the step where the view says they are held (fetched, returned, or checked all
together before an optimizer applies any); otherwise each is summed and freed once the last
op reading its x is differentiated, as an update in the same step consumes it (making one
temporary of its size, as SGD's learning rate times gradient). Gradients
computed from the seed of the loss alone are folded into constants ahead of the step, as graph
optimizers do.

With checkpoints, the forward pass keeps only the boundaries and what the last segment's
gradients read; each step then recomputes its segments into new buffers (with nested
checkpoints, keeping only those and recomputing the inner segments once more), differentiates
them, and frees the boundaries no later step reads.

Peaks count bytes above what is resident before the step: variables, constants, inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import tensorflow as tf

from memory_saving_gradients import costs
from memory_saving_gradients.schedule import Schedule, Segment
from memory_saving_gradients.view import ForwardView

#: The copy level of the tensors the forward pass computes.
ORIGINAL = 0


@dataclasses.dataclass(eq=False)
class _Buffer:
    size: int
    holders: int = 1
    #: A value graph optimizers compute ahead of the step (it takes no step memory).
    constant: bool = False


class _Run:
    """Buffers alive during one simulated step, and the largest total seen.

    A tensor is known by its ref and copy level: recomputed copies get levels of their own,
    and look up what they read at their level first, then at the levels they were copied
    from (`chain`, innermost first).
    """

    def __init__(self, view: ForwardView) -> None:
        self.view = view
        self.xs = {x.ref() for x in view.xs}
        self.cost = view.costs
        self.alive = 0
        self.peak = 0
        self.buffers: dict[tuple, _Buffer | None] = {}
        #: Gradient parts received for each tensor (by ref), not summed yet.
        self.parts: dict[object, list[_Buffer]] = {}
        #: Where gradients are applied as they complete: the readers not differentiated yet
        #: of each tensor whose gradient is an x's.
        self.readers_left: dict[object, int] = (
            {}
            if view.gradients_held
            else {t.ref(): len(set(view.consumers(t))) for t in _gradients_of_xs(view)}
        )
        #: (op, "forward" or "backward", copy level, bytes alive after it), in order.
        self.timeline: list[tuple[tf.Operation, str, int, int]] = []
        self._levels = itertools.count(ORIGINAL + 1)

    def new_level(self) -> int:
        return next(self._levels)

    def new(self, size: int) -> _Buffer:
        self.alive += size
        self.peak = max(self.peak, self.alive)
        return _Buffer(size)

    def hold(self, buffer: _Buffer | None) -> _Buffer | None:
        if buffer is not None:
            buffer.holders += 1
        return buffer

    def release(self, buffer: _Buffer | None) -> None:
        if buffer is not None:
            buffer.holders -= 1
            if buffer.holders == 0:
                self.alive -= buffer.size

    def buffer(self, tensor: tf.Tensor, chain: Sequence[int]) -> _Buffer | None:
        for level in chain:
            if (tensor.ref(), level) in self.buffers:
                return self.buffers[(tensor.ref(), level)]
        return None

    def forward(
        self,
        ops: Sequence[tf.Operation],
        chain: Sequence[int],
        uses: dict[object, int],
        inherited: frozenset = frozenset(),
    ) -> None:
        """Run `ops` in order as copies at level `chain[0]`. An output lives until its last
        reader among `ops` has run, and then for as many later uses as `uses` gives its ref:
        each later use releases it once. Tensors `inherited` (refs) from the levels copied
        from are released the same way: the step gets their last hold."""
        level = chain[0]
        made = {t.ref() for op in ops for t in op.outputs}
        owned = made | inherited
        readers: dict[object, int] = {}
        for op in ops:
            for t in op.inputs:
                if t.ref() in owned:
                    readers[t.ref()] = readers.get(t.ref(), 0) + 1
        for op in ops:
            cost = self.cost[op]
            dying = [
                self.buffer(t, chain)
                for t in op.inputs
                if t.ref() in owned and readers[t.ref()] == 1 and not uses.get(t.ref())
            ]
            for index, t in enumerate(op.outputs):
                buffer = self._output_buffer(op, index, cost, dying, chain)
                for _ in range(uses.get(t.ref(), 0)):
                    self.hold(buffer)
                self.buffers[(t.ref(), level)] = buffer
            for t in op.inputs:
                if t.ref() in owned:
                    readers[t.ref()] -= 1
                    if readers[t.ref()] == 0 and (t.ref() in made or not uses.get(t.ref())):
                        self.release(self.buffer(t, chain))
            for t in op.outputs:
                if t.ref() not in readers:
                    self.release(self.buffers[(t.ref(), level)])
            self.timeline.append((op, "forward", level, self.alive))

    def _output_buffer(self, op, index, cost, dying, chain) -> _Buffer | None:
        size = cost.output_bytes[index]
        if op.type in costs.ALIASING and op.inputs:
            return self.hold(self.buffer(op.inputs[0], chain))
        if size == 0:
            return None
        if index == 0 and cost.reuses_input:
            for buffer in dying:
                if buffer is not None and buffer.size == size and buffer.holders == 1:
                    dying.clear()  # one output takes over one buffer
                    return self.hold(buffer)
        return self.new(size)

    def differentiate(
        self,
        ops: Sequence[tf.Operation],
        chain: Sequence[int],
        recomputed: Iterable[tf.Operation] = (),
        inherited: frozenset = frozenset(),
    ) -> None:
        """Differentiate `ops` from last to first: the copies at level `chain[0]` of those
        `recomputed`, the ops of the levels copied from otherwise. What a gradient reads is
        released after the last gradient reading it: a copy's own outputs and `inherited`
        inputs, and what an op not recomputed here reads (held for that in `forward`); a
        copy's other inputs are the step's to release."""
        level, recomputed = chain[0], set(recomputed)
        last_reader: dict[object, tf.Operation] = {}
        for op in ops:
            for t in _read_by_gradient(op, self.cost[op]):
                last_reader.setdefault(t.ref(), op)
        for op in reversed(ops):
            copy = op in recomputed
            done = []
            for t in _read_by_gradient(op, self.cost[op]):
                if last_reader.get(t.ref()) is not op:
                    continue
                if copy and (t.ref(), level) in self.buffers:
                    done.append(self.buffers[(t.ref(), level)])
                elif not copy or t.ref() in inherited:
                    done.append(self.buffer(t, chain[1:] if copy else chain))
            done = [b for b in done if b is not None]
            self._differentiate_op(op, done)
            for buffer in done:
                self.release(buffer)
            self._apply_completed_gradients(op)
            self.timeline.append((op, "backward", level, self.alive))

    def _differentiate_op(self, op: tf.Operation, dying: list[_Buffer]) -> None:
        """Make the gradients of `op`'s inputs. Element-wise gradient kernels write into a
        buffer nothing else needs: the arriving gradient's, or one of `dying` (what the
        gradient reads for the last time)."""
        incoming = [self._summed_gradient(t) for t in op.outputs]
        arriving = next((b for b in incoming if b is not None), None)
        if arriving is None:
            return
        cost = self.cost[op]
        folded = arriving.constant and not (cost.saved_inputs or cost.saved_outputs)
        reusable = [b for b in [arriving, *dying] if b.holders == 1 and not b.constant]
        for t, made in zip(op.inputs, cost.input_gradients, strict=True):
            if made is None or (t.op not in self.cost and t.ref() not in self.xs):
                continue
            size = costs.tensor_bytes(t)
            if made == "alias":
                buffer = self.hold(arriving)
            elif folded:
                buffer = _Buffer(0, constant=True)
            elif made in costs.REUSES_INPUT_BUFFER and (
                taken := next((b for b in reusable if b.size == size), None)
            ):
                reusable.remove(taken)
                buffer = self.hold(taken)
            else:
                buffer = self.new(size)
            self.parts.setdefault(t.ref(), []).append(buffer)
        self.peak = max(self.peak, self.alive + cost.workspace)
        for buffer in incoming:
            self.release(buffer)

    def _apply_completed_gradients(self, op: tf.Operation) -> None:
        """Free the gradient of each x that `op` was the last reader of, once summed: an
        update applies it (where gradients are not held to the end of the step). A variable
        read passes its gradient on unchanged, with no gate to wait for: its output's
        gradient is applied as soon as it is complete."""
        for t in {t.ref(): t for t in op.inputs if t.ref() in self.readers_left}.values():
            self.readers_left[t.ref()] -= 1
            if not self.readers_left[t.ref()] and (summed := self._summed_gradient(t)):
                self.peak = max(self.peak, self.alive + summed.size)  # the update's temporary
                self.release(summed)
                if t.ref() in self.parts:
                    self.release(self.parts.pop(t.ref())[0])

    def _summed_gradient(self, tensor: tf.Tensor) -> _Buffer | None:
        """The gradient of `tensor`, its parts summed (into one of them where none is shared),
        held for the caller. The parts of an x stay until its gradient is applied, if ever."""
        parts = self.parts.get(tensor.ref(), [])
        if not parts:
            return None
        if len(parts) > 1:
            into = next((p for p in parts if p.holders == 1 and not p.constant), None)
            size = max(p.size for p in parts)
            total = into or (self.new(size) if size else _Buffer(0, constant=True))
            for part in parts:
                if part is not into:
                    self.release(part)
            parts[:] = [total]
        if tensor.ref() in self.xs:
            return self.hold(parts[0])
        return self.parts.pop(tensor.ref())[0]


def _gradients_of_xs(view: ForwardView) -> list[tf.Tensor]:
    """The tensors whose gradients are those of xs: the xs, and what the ops reading an x
    without being recomputed (variable reads) make of it."""
    return [
        *view.xs,
        *(
            out
            for x in view.xs
            for op in set(view.consumers(x))
            if op not in view.recomputable
            for out in op.outputs
            if out.dtype.is_floating
        ),
    ]


def _read_by_gradient(op: tf.Operation, cost: costs.OpCost) -> list[tf.Tensor]:
    read = [op.inputs[i] for i in cost.saved_inputs] + [op.outputs[i] for i in cost.saved_outputs]
    return list({t.ref(): t for t in read}.values())


def _uses(ops_differentiated: Iterable[tf.Operation], cost: dict) -> dict[object, int]:
    """Refs of the tensors the gradients of `ops_differentiated` read, each counted once."""
    return {t.ref(): 1 for op in ops_differentiated for t in _read_by_gradient(op, cost[op])}


def _add(uses: dict[object, int], more: Iterable[object]) -> dict[object, int]:
    for ref in more:
        uses[ref] = uses.get(ref, 0) + 1
    return uses


def plain_peak(view: ForwardView) -> int:
    """Simulated peak bytes of backprop that keeps every activation its gradients read."""
    run = _Run(view)
    ops = list(view.ops)
    run.forward(ops, (ORIGINAL,), _add(_uses(ops, run.cost), (y.ref() for y in view.ys)))
    _seed(run, view)
    run.differentiate(ops, (ORIGINAL,))
    return run.peak


def checkpointed_peak(
    view: ForwardView, levels: Sequence[Sequence[tf.Tensor]], schedule: Schedule | None = None
) -> int:
    """Simulated peak bytes of backprop keeping the tensors of `levels[0]` (whose `schedule`
    may be given), and those of each further level while the segment around them is
    recomputed."""
    run = _Run(view)
    schedule = schedule or Schedule.build(view, levels[0])
    segments = _segments(schedule)
    last = _ops_of(view, schedule.last)
    uses = _add(_uses(last, run.cost), (y.ref() for y in view.ys))
    for segment in segments:
        _add(uses, _uses([op for op in view.ops if op in segment.originals], run.cost))
        _add(uses, (t.ref() for t in segment.frontier))
    run.forward(list(view.ops), (ORIGINAL,), uses)
    _seed(run, view)
    run.differentiate(last, (ORIGINAL,))
    _steps(run, view, schedule, segments, levels[1:], (ORIGINAL,))
    return run.peak


def _steps(run: _Run, view, schedule, segments: Sequence[Segment], nested, outer: tuple) -> None:
    """Simulate the steps of `segments` of `schedule`, whose boundaries live at the levels of
    `outer`; `nested` gives the checkpoints of each further level."""
    last_read = {t.ref(): j for j, s in enumerate(segments) for t in s.frontier}
    for j, segment in enumerate(segments):
        chain = (run.new_level(), *outer)
        inherited = frozenset(t.ref() for t in segment.frontier if last_read[t.ref()] == j)
        inner = [t for t in (nested[0] if nested else ()) if t.op in segment.ops]
        if inner:
            ends = [t for op in segment.ops for t in op.outputs if schedule.is_boundary(t)]
            _nested_step(run, view, segment, ends, inner, nested[1:], chain, inherited)
        else:
            recomputed = [op for op in view.ops if op in segment.ops]
            run.forward(recomputed, chain, _uses(recomputed, run.cost), inherited)
            run.differentiate(_ops_of(view, segment), chain, recomputed, inherited)
        for t in segment.frontier:
            if t.ref() not in inherited:
                run.release(run.buffer(t, outer))


def _nested_step(run, view, segment, ends, inner, deeper, chain, inherited) -> None:
    """A step recomputing `segment` (up to its boundaries `ends`) while keeping only its
    `inner` checkpoints: the last inner segment is differentiated as recomputed, the others
    are recomputed once more."""
    schedule = Schedule.build(ForwardView.build(ends, list(segment.frontier)), inner)
    segments = [s for s in _segments(schedule) if s.ops]
    last = [op for op in _ops_of(view, schedule.last) if op in segment.ops]
    recomputed = [op for op in view.ops if op in segment.ops]
    uses = _uses(last, run.cost)
    for s in segments:
        _add(uses, (t.ref() for t in s.frontier if t.op in segment.ops))
    run.forward(recomputed, chain, uses, inherited)
    run.differentiate(last, chain, recomputed, inherited)
    _steps(run, view, schedule, segments, deeper, chain)


def _segments(schedule: Schedule) -> list[Segment]:
    return [Segment.union([schedule.segments[op] for op in step]) for step in schedule.steps]


def _ops_of(view: ForwardView, segment: Segment) -> list[tf.Operation]:
    return [op for op in view.ops if op in segment.ops or op in segment.originals]


def _seed(run: _Run, view: ForwardView) -> None:
    """The gradients of the ys: given ones, or ones graph optimizers fold into constants."""
    for y in view.ys:
        seed = run.new(costs.tensor_bytes(y)) if view.given_grad_ys else _Buffer(0, constant=True)
        run.parts.setdefault(y.ref(), []).append(seed)
