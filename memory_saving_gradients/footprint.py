"""The memory a training step needs, simulated: bytes alive as the executor runs it.

A step is simulated op by op, forward in the view's topological order, then backward in
reverse, the way TensorFlow's executor runs a backward pass the gates order. An op's outputs
are allocated while its inputs are still alive; then every buffer no tensor needs any more is
freed. Tensors share buffers where TensorFlow's kernels share them: reshapes and identities
alias their input, element-wise kernels write into an input buffer nothing else needs
(`costs.REUSES_INPUT_BUFFER`). Backprop keeps what each gradient reads (`costs.OpCost`) until
that gradient has run. Each op's gradient is simulated as the ops of its registered gradient
function (`costs.GradientUse`) running on the buffers they read, so a gradient passed on
unchanged (an Add's) aliases the arriving one, and a temporary lives until its last reader.
The gradient parts of one tensor are summed once all have arrived (an AddN runs once its
inputs exist). Gradients of xs live to the end of the step where the view says they are
held (fetched, returned, or checked all together before an optimizer applies any); otherwise
each is freed once the last op reading its x is differentiated, as an update in the same
step consumes it (making one temporary of its size, as SGD's learning rate times gradient).
What a gradient computes from constants alone (the seed of the loss, static shapes) is folded
ahead of the step, as graph optimizers do.

With checkpoints, the forward pass keeps only the boundaries and what the last segment's
gradients read; each step then recomputes its segments into new buffers (with nested
checkpoints, keeping only those and recomputing the inner segments once more), differentiates
them, and frees the boundaries no later step reads. A recomputed op whose outputs nothing
reads is not run: the executor prunes it.

What this leaves out, measured against TensorFlow (benchmarks/cost_model.py): the executor
times ops to choose which of the ready ones wait, so it may run a gradient's ops that read
only forward tensors before the gradient arrives, or leave a weight gradient queued, and hold
their tensors meanwhile; and graph optimizers rewrite gradients (an attention's softmax
gradient times its scale becomes a product with `softmax * scale`, computed as soon as the
softmax is recomputed).

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
        #: Parts each tensor (by ref) is still to receive: one from each op reading it.
        self.expected: dict[object, int] = {}
        for op in view.ops:
            for t, needed in zip(op.inputs, self.cost[op].needed, strict=True):
                if needed and (t.op in self.cost or t.ref() in self.xs):
                    self.expected[t.ref()] = self.expected.get(t.ref(), 0) + 1
        #: Where gradients are applied as they complete: the readers not differentiated yet
        #: of each tensor whose gradient is an x's.
        self.readers_left: dict[object, int] = (
            {}
            if view.gradients_held
            else {t.ref(): len(set(view.consumers(t))) for t in view.gradients_of_xs}
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
        """Run `ops` in order as copies at level `chain[0]`, those an executor runs: whose
        outputs are used later (`uses`) or read by ops that run. An output lives until its
        last reader among `ops` has run, and then for as many later uses as `uses` gives its
        ref: each later use releases it once. Tensors `inherited` (refs) from the levels
        copied from are released the same way: the step gets their last hold."""
        level = chain[0]
        ops = _run_by_executor(ops, uses)
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
        copy's other inputs are the step's to release. The gradient parts a tensor receives
        from `ops` are summed once the last of them has arrived (one gradient call sums its
        own parts), and all its parts once none is to come from anywhere."""
        level, recomputed = chain[0], set(recomputed)
        last_reader: dict[object, tf.Operation] = {}
        for op in ops:
            for t in _read_by_gradient(op, self.cost[op]):
                last_reader.setdefault(t.ref(), op)
        # The parts each tensor is to receive from `ops`, and how many it had before.
        pending: dict[object, int] = {}
        before: dict[object, int] = {}
        for op in ops:
            for t, needed in zip(op.inputs, self.cost[op].needed, strict=True):
                if needed:
                    pending[t.ref()] = pending.get(t.ref(), 0) + 1
                    before.setdefault(t.ref(), len(self.parts.get(t.ref(), ())))
        for op in reversed(ops):
            copy = op in recomputed
            read: dict[object, _Buffer | None] = {}
            done = []
            for t in _read_by_gradient(op, self.cost[op]):
                at_level = copy and (t.ref(), level) in self.buffers
                buffer = self.buffer(t, chain if at_level or not copy else chain[1:])
                read[t.ref()] = buffer
                released_here = at_level or not copy or t.ref() in inherited
                if last_reader.get(t.ref()) is op and released_here and buffer is not None:
                    done.append(buffer)
            received = self._differentiate_op(op, read, done)
            for buffer in done:
                self.release(buffer)
            for t in received:
                pending[t.ref()] -= 1
                self.expected[t.ref()] = self.expected.get(t.ref(), 0) - 1
                parts = self.parts[t.ref()]
                if self.expected[t.ref()] <= 0:
                    parts[:] = [self._sum(parts)]
                elif pending[t.ref()] == 0 and len(parts) > before[t.ref()] + 1:
                    parts[before[t.ref()] :] = [self._sum(parts[before[t.ref()] :])]
            self._apply_completed_gradients(op)
            self.timeline.append((op, "backward", level, self.alive))

    def _differentiate_op(
        self, op: tf.Operation, read: dict[object, _Buffer | None], dying: list[_Buffer]
    ) -> list[tf.Tensor]:
        """Make the gradients of `op`'s inputs from those of its outputs, running its gradient
        function's ops (`costs.GradientUse`) on the buffers of what it reads (`read`, by
        ref); an element-wise op may write into a buffer nothing else needs: a temporary it
        reads for the last time, the arriving gradient, or one of `dying` (what backprop
        reads for the last time here). Returns the inputs that received a gradient part."""
        incoming = [self._summed_gradient(t) for t in op.outputs]
        if all(b is None for b in incoming):
            return []
        cost = self.cost[op]
        wanted = [
            want and (t.op in self.cost or t.ref() in self.xs)
            for t, want in zip(op.inputs, cost.needed, strict=True)
        ]
        if cost.gradient is None:
            made = [
                self.new(costs.tensor_bytes(t)) if want else None
                for t, want in zip(op.inputs, wanted, strict=True)
            ]
        else:
            made = self._run_gradient(op, cost.gradient, wanted, incoming, read, dying)
        received = []
        for t, buffer in zip(op.inputs, made, strict=True):
            if buffer is not None:
                self.parts.setdefault(t.ref(), []).append(buffer)
                received.append(t)
        for buffer in incoming:
            self.release(buffer)
        return received

    def _run_gradient(
        self,
        op: tf.Operation,
        use: costs.GradientUse,
        wanted: Sequence[bool],
        incoming: Sequence[_Buffer | None],
        read: dict[object, _Buffer | None],
        dying: list[_Buffer],
    ) -> list[_Buffer | None]:
        """Run the steps of `use` that the `wanted` input gradients need; return a held
        buffer for each wanted input's gradient (None for the others). A step reading only
        constants (the folded seed of the ys, static shapes) is folded too."""
        value: dict[int, _Buffer] = {}
        for seed, buffer in zip(use.seeds, incoming, strict=True):
            if seed is not None:  # an output without gradient gets zeros, folded
                value[seed] = buffer if buffer is not None else _Buffer(0, constant=True)
        for placeholder, kind, index in use.captured:
            tensor = (op.inputs if kind == "in" else op.outputs)[index]
            # A resident tensor (a variable's value): never freed here, never written into.
            value[placeholder] = read.get(tensor.ref()) or _Buffer(0, holders=2)
        needed = frozenset().union(*(n for n, want in zip(use.needs, wanted, strict=True) if want))
        steps = [step for i, step in enumerate(use.steps) if i in needed]
        readers: dict[int, int] = {}
        for step in steps:
            for t in step.reads:
                readers[t] = readers.get(t, 0) + 1
        returned = {r for r, want in zip(use.returned, wanted, strict=True) if want}
        made: set[int] = set()
        dying_ids = {id(b) for b in dying}
        for step in steps:
            reads = [value.get(t) or _Buffer(0, constant=True) for t in step.reads]
            folded = step.folded or all(b.constant for b in reads)
            free = [
                b
                for t, b in zip(step.reads, reads, strict=True)
                if readers[t] == 1
                and b.holders == 1
                and not b.constant
                and (t in made or id(b) in dying_ids or b in incoming)
            ]
            for t, size in zip(step.outputs, step.sizes, strict=True):
                if folded:
                    buffer = _Buffer(0, constant=True)
                elif step.aliases:
                    buffer = self.hold(reads[0])
                elif step.reuses_input and (
                    taken := next((b for b in free if b.size == size), None)
                ):
                    free.remove(taken)
                    buffer = self.hold(taken)
                else:
                    buffer = self.new(size)
                value[t] = buffer
                made.add(t)
                if t not in readers and t not in returned:
                    self.release(buffer)
            for t in step.reads:
                readers[t] -= 1
                if readers[t] == 0 and t in made and t not in returned:
                    self.release(value[t])
        gradients = [
            self.hold(value.get(r) or _Buffer(0, constant=True))
            if want and r is not None
            else None
            for r, want in zip(use.returned, wanted, strict=True)
        ]
        for t in returned & made:
            self.release(value[t])
        return gradients

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
        """The gradient of `tensor`, its parts summed, held for the caller. The parts of an x
        stay until its gradient is applied, if ever."""
        parts = self.parts.get(tensor.ref(), [])
        if not parts:
            return None
        parts[:] = [self._sum(parts)]
        if tensor.ref() in self.xs:
            return self.hold(parts[0])
        return self.parts.pop(tensor.ref())[0]

    def _sum(self, parts: Sequence[_Buffer]) -> _Buffer:
        """The sum of gradient `parts`, which it releases: written into one of them that
        nothing else holds (as TensorFlow's AddN forwards an input buffer), else new."""
        if len(parts) == 1:
            return parts[0]
        into = next((p for p in parts if p.holders == 1 and not p.constant), None)
        size = max(p.size for p in parts)
        total = into or (self.new(size) if size else _Buffer(0, constant=True))
        for part in parts:
            if part is not into:
                self.release(part)
        return total


def _run_by_executor(ops: Sequence[tf.Operation], uses: dict[object, int]) -> list[tf.Operation]:
    """The ops of `ops` (in order) that an executor runs: those whose outputs are used later
    (`uses`) or read by ops that run. The others' outputs nothing needs (a recomputed
    concatenation whose gradient reads none of it), so the executor prunes them. Gradients
    may read the shape of any tensor around their op, which graph optimizers fold where it
    is static: a tensor whose static shape is not fully known is taken to be needed."""
    wanted = {ref for ref, count in uses.items() if count}
    wanted.update(
        t.ref() for op in ops for t in (*op.inputs, *op.outputs) if not t.shape.is_fully_defined()
    )
    run = []
    for op in reversed(ops):
        if any(t.ref() in wanted for t in op.outputs):
            run.append(op)
            wanted.update(t.ref() for t in op.inputs)
    return run[::-1]


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
