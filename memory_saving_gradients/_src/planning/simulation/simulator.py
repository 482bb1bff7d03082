"""One training step's ops run on a ledger of buffers, as TensorFlow's executor runs them:
forward, pruned as the executor prunes, then backward, each op's gradient replayed kernel by
kernel as the ops of its gradient function (`replay`), gradient parts summed, and completed
gradients applied (the model: the package's docstring).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import costs, kernels
from memory_saving_gradients._src.analysis.execution import execution_of
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning.simulation import executor, replay
from memory_saving_gradients._src.planning.simulation.ledger import Buffer, Ledger
from memory_saving_gradients._src.planning.simulation.numbering import Numbering
from memory_saving_gradients._src.planning.simulation.replay import GradientRun


class Simulator:
    """The ops of one training step run on a `Ledger` of the buffers alive.

    Tensors and ops are known by their ids in the view's `Numbering` (ops by position); a
    tensor's buffer also by its copy level (`Ledger`).
    """

    def __init__(
        self,
        view: ForwardView,
        updates_copy: bool = False,
        products_ahead: bool = False,
        limit: float = math.inf,
        registered_gradients: bool = False,
    ) -> None:
        self.view = view
        self.execution = execution_of(view)
        #: Whether an update copies its variable (plain `tf.gradients`: see the package's
        #: docstring).
        self.updates_copy = updates_copy
        #: Bytes of the product TensorFlow's optimizers move ahead of each op's gradient, by
        #: the op's position, where they do (plain `tf.gradients`: `Execution.
        #: products_ahead`), and the buffer of each made so far.
        self.ahead_bytes: dict[int, int] = (
            {
                view.position[op]: kernels.tensor_bytes(t)
                for op, t in self.execution.products_ahead.items()
            }
            if products_ahead
            else {}
        )
        self.ahead: dict[int, Buffer] = {}
        self.ids = Numbering.of(view)
        #: The cost of each op, by position: with TensorFlow's registered gradients where
        #: `registered_gradients` (plain `tf.gradients`), else the library's backprop's own.
        self.cost = [
            dataclasses.replace(cost, gradient=cost.tensorflow_gradient)
            if registered_gradients and cost.tensorflow_gradient is not None
            else cost
            for cost in (view.costs[op] for op in view.ops)
        ]
        #: What each op's gradient reads, by position.
        self.read = self.ids.gradient_reads
        #: `replay.needed_steps` of each gradient use and wanted inputs met so far, by the use's id
        #: (few: ops of one kind share a use).
        self.gradient_steps: dict[tuple, tuple] = {}
        #: The steps each kernel of a gradient use runs, in order, by the use's id and the
        #: inputs it makes gradients for.
        self.kernel_steps: dict[tuple, tuple[int, ...]] = {}
        #: The buffers alive, and the most bytes alive at once (up to `limit`: `Ledger`).
        self.ledger = Ledger(limit)
        #: Whether the step is compiled by XLA, which copies some gated tensors (`gate_copies`).
        self.xla = _tf.compiled_by_xla(view.ys[0].graph) if view.ys else False
        #: Threads running the step's ops: with more than one, ready gradients run side by
        #: side (`executor`), and so do the kernels of one gradient. XLA runs its compiled
        #: schedule one op at a time, as the one-thread order has it.
        self.threads = 1 if self.xla else kernels.inter_op_threads()
        #: Gradient parts received for each tensor, not summed yet.
        self.parts: dict[int, list[Buffer]] = {}
        #: Parts each tensor is still to receive: one from each op reading it.
        self.expected = list(self.ids.gradient_parts)
        #: Buffers of tensors made outside the view to release once the forward pass has run
        #: the op at a position (`made_outside`).
        self.released_after: dict[int, list[Buffer]] = {}
        #: What a step makes again just before its copy of the op at a position runs: the
        #: bytes, those drawn on the way, and where to keep its buffer (`remake`).
        self.drawn_before: dict[int, list[tuple[int, int, list[Buffer]]]] = {}
        #: Where gradients are applied as they complete: the readers not differentiated yet
        #: of each tensor whose gradient is an x's.
        self.readers_left: dict[int, int] = (
            {}
            if view.gradients_held
            else {t: self.ids.readers[t] for t in self.tensor_ids(self.execution.gradients_of_xs)}
        )

    def made_outside(self, remade: Collection[object] = ()) -> None:
        """Hold what the step makes outside the view for the view's ops (`Execution.
        made_outside`) from its start to its end: it needs nothing the view makes, so the
        executor makes it as the step starts (a dropout's mask, from the seed the step reads),
        and the gradients of its readers read it (a select's reads its condition). What the
        steps make again (`remade`, by `ref()`) lives until its last reader in the forward
        pass has run (`forward`)."""
        position = self.view.position
        for group in self.execution.made_outside_groups:
            buffer = self.ledger.new(kernels.tensor_bytes(group[0]))
            if all(t.ref() in remade for t in group):
                last = max(position[op] for t in group for op in t.consumers() if op in position)
                self.released_after.setdefault(last, []).append(buffer)

    def remake(self, ops: Sequence[int], remade: Collection[object]) -> list[Buffer]:
        """Make again the tensors made outside the view that `ops` (the ops a step runs
        again, in order) read and that the step makes again (`remade`): one buffer for each
        set that identical ops compute, with the largest tensor drawn on the way alive beside
        it, once `forward` reaches the first reader's copy (the draw waits for the copies one
        before it: `Execution.drawn_after`). Returns the list of their buffers, filled as they
        are made, which the step releases as it ends."""
        view, execution = self.view, self.execution
        read = {t.ref() for op in ops for t in view.ops[op].inputs if t.ref() in remade}
        made: list[Buffer] = []
        for group in execution.made_outside_groups:
            found = {t.ref(): t for t in group if t.ref() in read}
            if not found:
                continue
            drawing = execution.remakeable[next(iter(found))]
            drawn = max(
                (kernels.tensor_bytes(o) for op in drawing[:-1] for o in op.outputs), default=0
            )
            first = min(op for op in ops if any(t.ref() in found for t in view.ops[op].inputs))
            self.drawn_before.setdefault(first, []).append(
                (kernels.tensor_bytes(group[0]), drawn, made)
            )
        return made

    def seed(self) -> None:
        """The gradients of the ys: given ones, or ones graph optimizers fold into constants."""
        view = self.view
        for y in view.ys:
            seed = (
                self.ledger.new(kernels.tensor_bytes(y))
                if view.given_grad_ys
                else Buffer(0, constant=True)
            )
            self.parts.setdefault(self.ids.ids[y.ref()], []).append(seed)

    def gate_copies(
        self,
        read: Iterable[int],
        ops: Sequence[int],
        chain: Sequence[int],
        inherited: frozenset[int],
    ) -> frozenset[int]:
        """Under XLA, the copies a step recomputing `ops` at level `chain[0]` makes of the
        tensors it reads through its gate (`read`) that a contraction among `ops` reads
        (`kernels.CONTRACTIONS`; XLA fuses `x - 0` into element-wise readers, NOTE [gates under
        XLA] in `gates.py`): weights and boundaries. Each lives at that level until
        its last reader there; the step's last hold on an `inherited` original is given up
        as it is copied. Returns the copied tensors, which the step releases as it does
        what it inherits."""
        if not self.xla:
            return frozenset()
        ledger = self.ledger
        read = set(read)
        copied = {
            t
            for op in ops
            if self.view.ops[op].type in kernels.CONTRACTIONS
            for t in self.ids.inputs[op]
            if t in read
        }
        at_level = ledger.levels[chain[0]]
        for t in sorted(copied):
            original = ledger.buffer(t, chain)
            at_level[t] = ledger.new(kernels.tensor_bytes(self.ids.tensors[t]))
            if t in inherited:
                ledger.release(original)
        return frozenset(copied)

    def forward_order(self) -> list[int]:
        """The positions of the view's ops in the order the forward pass runs them: in
        topological order, but for weight ops that nothing makes wait, which run as the step
        starts (NOTE [weight ops wait for their readers] in analysis/execution.py)."""
        view = self.view
        order = list(range(len(view.ops)))
        if not self.execution.weight_ops_run_early:
            return order
        early = view.weight_ops | {t.op for op in view.weight_ops for t in op.inputs}
        return sorted(order, key=lambda position: view.ops[position] not in early)

    def positions(self, ops: Iterable[tf.Operation]) -> list[int]:
        """The positions of those of `ops` that are the view's, in topological order."""
        position = self.view.position
        return sorted(position[op] for op in ops if op in position)

    def tensor_ids(self, tensors: Iterable[tf.Tensor]) -> list[int]:
        return [self.ids.ids[t.ref()] for t in tensors]

    def forward(
        self,
        ops: Sequence[int],
        chain: Sequence[int],
        uses: dict[int, int],
        inherited: frozenset[int] = frozenset(),
    ) -> None:
        """Run `ops` in order as copies at level `chain[0]`, those an executor runs: whose
        outputs are used later (`uses`) or read by ops that run. An output lives until its
        last reader among `ops` has run, and then for as many later uses as `uses` gives
        it: each later use releases it once. Tensors `inherited` from the levels copied
        from are released the same way: the step gets their last hold."""
        ledger = self.ledger
        at_level = ledger.levels[chain[0]]
        all_inputs, all_outputs = self.ids.inputs, self.ids.outputs
        ops = self._run_by_executor(ops, uses)
        made = {t for op in ops for t in all_outputs[op]}
        owned = made | inherited
        readers: dict[int, int] = {}
        for op in ops:
            for t in all_inputs[op]:
                if t in owned:
                    readers[t] = readers.get(t, 0) + 1
        for op in ops:
            for size, drawn, made_here in self.drawn_before.pop(op, ()):
                made_here.append(ledger.new(size))
                ledger.working(drawn)
            cost, inputs = self.cost[op], all_inputs[op]
            dying = [
                ledger.buffer(t, chain)
                for t in inputs
                if t in owned and readers[t] == 1 and not uses.get(t)
            ]
            for index, t in enumerate(all_outputs[op]):
                buffer = self._output_buffer(op, index, cost, dying, chain)
                if buffer is not None:
                    buffer.holders += uses.get(t, 0)
                at_level[t] = buffer
            ledger.working(cost.working)
            if op in self.ahead_bytes:
                self.ahead[op] = ledger.new(self.ahead_bytes[op])
            for t in inputs:
                if t in owned:
                    readers[t] -= 1
                    if readers[t] == 0 and (t in made or not uses.get(t)):
                        ledger.release(ledger.buffer(t, chain))
            for t in all_outputs[op]:
                if t not in readers:
                    ledger.release(at_level[t])
            for buffer in self.released_after.pop(op, ()):
                ledger.release(buffer)

    def _output_buffer(
        self,
        op: int,
        index: int,
        cost: costs.OpCost,
        dying: list[Buffer | None],
        chain: Sequence[int],
    ) -> Buffer | None:
        size = cost.output_bytes[index]
        inputs = self.ids.inputs[op]
        if cost.aliases and inputs:
            return self.ledger.hold(self.ledger.buffer(inputs[0], chain))
        if size == 0:
            return None
        if index == 0 and cost.reuses_input:
            for buffer in dying:
                if buffer is not None and buffer.size == size and buffer.holders == 1:
                    dying.clear()  # one output takes over one buffer
                    return self.ledger.hold(buffer)
        return self.ledger.new(size)

    def differentiate(
        self,
        ops: Sequence[int],
        chain: Sequence[int],
        recomputed: Iterable[int] = (),
        inherited: frozenset[int] = frozenset(),
    ) -> None:
        """Differentiate `ops` as the executor's threads run their gradients' kernels
        (`_backward_events`; one thread: from last to first): the copies at level `chain[0]`
        of those `recomputed`, the ops of the levels copied from otherwise. A kernel
        allocates what it makes when it starts; an op's gradient lets go of what it read as
        the last of its kernels reading it finishes. What a gradient reads is released after
        the last gradient reading it finishes: a copy's own outputs and `inherited` inputs,
        and what an op not recomputed here reads (held for that in `forward`); a copy's other
        inputs are the step's to release. A gradient part arrives as the kernel making it
        finishes. The parts a tensor receives from `ops` are summed once the last of them has
        arrived (one gradient call sums its own parts), and all its parts once none is to come
        from anywhere."""
        ledger = self.ledger
        at_level, outer, recomputed = ledger.levels[chain[0]], chain[1:], set(recomputed)
        events = self._backward_events(ops)
        last_reader: dict[int, int] = {}
        for op, _, starts in reversed(events):
            if not starts:
                for t in self.read[op]:
                    last_reader.setdefault(t, op)
        # The parts each tensor is to receive from `ops`, and how many it had before.
        pending: dict[int, int] = {}
        before: dict[int, int] = {}
        for op in ops:
            for t, needed in zip(self.ids.inputs[op], self.cost[op].needed, strict=True):
                if needed:
                    pending[t] = pending.get(t, 0) + 1
                    before.setdefault(t, len(self.parts.get(t, ())))
        running: dict[int, GradientRun] = {}
        for op, kernel, starts in events:
            if starts:
                if op not in running:
                    copy = op in recomputed
                    read: dict[int, Buffer | None] = {}
                    done: dict[int, Buffer] = {}
                    for t in self.read[op]:
                        here = copy and t in at_level
                        buffer = ledger.buffer(t, chain if here or not copy else outer)
                        read[t] = buffer
                        released_here = here or not copy or t in inherited
                        if last_reader[t] == op and released_here and buffer is not None:
                            done[t] = buffer
                    running[op] = self._start_gradient(op, read, done)
                self._run_kernel(running[op], kernel)
                continue
            gradient = running[op]
            for t in gradient.received.pop(kernel, ()):
                pending[t] -= 1
                self.expected[t] -= 1
                parts = self.parts[t]
                if self.expected[t] <= 0:
                    parts[:] = [self._sum(parts)]
                elif pending[t] == 0 and len(parts) > before[t] + 1:
                    parts[before[t] :] = [self._sum(parts[before[t] :])]
            gradient.kernels_left -= 1
            for buffer, kernels_reading in gradient.read_by:
                kernels_reading.discard(kernel)
                if not kernels_reading:
                    ledger.release(buffer)
            gradient.read_by = [entry for entry in gradient.read_by if entry[1]]
            if not gradient.kernels_left:
                del running[op]
                for buffer in gradient.spent:
                    ledger.release(buffer)
                if op in self.ahead:
                    ledger.release(self.ahead.pop(op))
                self._apply_completed_gradients(op)

    def _backward_events(self, ops: Sequence[int]) -> list[executor.Event]:
        """When the kernels of the gradients of `ops` start and finish on the executor's
        threads (`executor`): each op's gradient waits for the kernels making the gradients
        of what its op makes."""
        return executor.backward_events(ops, self.ids.gradient_kernels, self.threads)

    def _start_gradient(
        self, op: int, read: dict[int, Buffer | None], dying: dict[int, Buffer]
    ) -> GradientRun:
        """Begin `op`'s gradient as its first kernel starts: take the gradients of its
        outputs, and the buffers of what it reads (`read`), of which those `dying`, by
        tensor, are read for the last time: each let go as the last kernel reading it
        finishes."""
        incoming = [self._summed_gradient(t) for t in self.ids.outputs[op]]
        kernel_reads = self.ids.kernel_reads[op]
        spent, read_by = [b for b in incoming if b is not None], []
        for t, held in dying.items():
            kernels_reading = {k for k, reads in enumerate(kernel_reads) if t in reads}
            if 0 < len(kernels_reading) < len(kernel_reads):
                read_by.append((held, kernels_reading))
            else:
                spent.append(held)
        gradient = GradientRun(
            op=op,
            incoming=incoming,
            spent=spent,
            kernels_left=len(self.ids.gradient_kernels[op]),
            dying={id(held) for held in dying.values()},
            read_by=read_by,
        )
        if all(b is None for b in incoming):
            return gradient  # no gradient arrives: its kernels make nothing
        cost, inputs = self.cost[op], self.ids.inputs[op]
        gets_gradient = self.ids.receives_gradient
        gradient.wanted = [
            want and gets_gradient[t] for t, want in zip(inputs, cost.needed, strict=True)
        ]
        use = cost.gradient
        if use is None:
            return gradient
        for seed, buffer in zip(use.seeds, incoming, strict=True):
            if seed is not None:  # an output without gradient gets zeros, folded
                gradient.value[seed] = buffer if buffer is not None else Buffer(0, constant=True)
        for placeholder, kind, index in use.captured:
            tensor = (inputs if kind == "in" else self.ids.outputs[op])[index]
            # A resident tensor (a variable's value): never freed here, never written into.
            gradient.value[placeholder] = read.get(tensor) or Buffer(0, holders=2)
        key = (id(use), tuple(gradient.wanted))
        if key not in self.gradient_steps:
            self.gradient_steps[key] = replay.needed_steps(use, gradient.wanted)
        step_readers, gradient.returned, gradient.working = self.gradient_steps[key]
        gradient.readers = dict(step_readers)
        return gradient

    def _run_kernel(self, gradient: GradientRun, kernel: int) -> None:
        """Run one of the kernels of `gradient`'s op (`Numbering.kernel_inputs`): make the
        gradients of its inputs from those of the op's outputs, as parts of their
        gradients."""
        if not gradient.wanted:
            return
        op, ledger = gradient.op, self.ledger
        cost, inputs = self.cost[op], self.ids.inputs[op]
        group = self.ids.kernel_inputs[op][kernel]
        made: dict[int, Buffer | None]
        if cost.gradient is None:
            made = {
                i: ledger.new(kernels.tensor_bytes(self.ids.tensors[inputs[i]])) for i in group
            }
        else:
            use = cost.gradient
            key = (id(use), group)
            if key not in self.kernel_steps:
                self.kernel_steps[key] = tuple(sorted(set().union(*(use.needs[i] for i in group))))
            made = replay.run_steps(
                ledger,
                gradient,
                use,
                group,
                self.kernel_steps[key],
                count_step_scratch=cost.gradient_working is None,
                side_by_side=self.threads > 1,
            )
        if cost.gradient_working and not gradient.scratch_counted:
            gradient.scratch_counted = True  # all its kernels' scratch at once (`OpCost`)
            ledger.working(cost.gradient_working)
        received = gradient.received.setdefault(kernel, [])
        for i, buffer in made.items():
            if buffer is not None:
                self.parts.setdefault(inputs[i], []).append(buffer)
                received.append(inputs[i])

    def _apply_completed_gradients(self, op: int) -> None:
        """Free the gradient of each x that `op` was the last reader of, once summed: an
        update applies it (where gradients are not held to the end of the step), holding its
        own temporaries (`ForwardView.update_scratch`) and copying its variable where
        `updates_copy`. A variable read passes its gradient on unchanged, with no gate to
        wait for: its output's gradient is applied as soon as it is complete."""
        scratch = self.view.update_scratch + (1 if self.updates_copy else 0)
        for t in dict.fromkeys(t for t in self.ids.inputs[op] if t in self.readers_left):
            self.readers_left[t] -= 1
            if not self.readers_left[t] and (summed := self._summed_gradient(t)):
                if scratch:  # temporaries alive while the update runs
                    self.ledger.working(round(scratch * summed.size))
                self.ledger.release(summed)
                if t in self.parts:
                    self.ledger.release(self.parts.pop(t)[0])

    def _summed_gradient(self, tensor: int) -> Buffer | None:
        """The gradient of `tensor`, its parts summed, held for the caller. The parts of an x
        stay until its gradient is applied, if ever."""
        parts = self.parts.get(tensor, [])
        if not parts:
            return None
        parts[:] = [self._sum(parts)]
        if tensor in self.ids.xs:
            return self.ledger.hold(parts[0])
        return self.parts.pop(tensor)[0]

    def _sum(self, parts: Sequence[Buffer]) -> Buffer:
        """The sum of gradient `parts`, which it releases: written into one of them that
        nothing else holds (as TensorFlow's AddN forwards an input buffer), else new."""
        if len(parts) == 1:
            return parts[0]
        into = next((p for p in parts if p.holders == 1 and not p.constant), None)
        size = max(p.size for p in parts)
        total = into or (self.ledger.new(size) if size else Buffer(0, constant=True))
        for part in parts:
            if part is not into:
                self.ledger.release(part)
        return total

    def _run_by_executor(self, ops: Sequence[int], uses: dict[int, int]) -> list[int]:
        """The ops of `ops` (in order) that an executor runs: those whose outputs are used
        later (`uses`) or read by ops that run. The others' outputs nothing needs (a
        recomputed concatenation whose gradient reads none of it), so the executor prunes
        them. Gradients may read the shape of any tensor around their op, which graph
        optimizers fold where it is static: a tensor whose static shape is not fully known
        is taken to be needed."""
        inputs, outputs, open_ = self.ids.inputs, self.ids.outputs, self.ids.open
        wanted = {t for t, count in uses.items() if count}
        if open_:
            wanted.update(t for op in ops for t in (*inputs[op], *outputs[op]) if t in open_)
        run = []
        for op in reversed(ops):
            if any(t in wanted for t in outputs[op]):
                run.append(op)
                wanted.update(inputs[op])
        return run[::-1]

    def uses(self, ops_differentiated: Iterable[int]) -> dict[int, int]:
        """The tensors the gradients of `ops_differentiated` read, each counted once."""
        return {t: 1 for op in ops_differentiated for t in self.read[op]}
