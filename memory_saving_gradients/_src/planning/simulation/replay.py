"""An op's gradient replayed on a ledger of buffers as the steps of its registered gradient
function (`gradient_uses.GradientUse`), one kernel at a time: what each step reads, makes and
lets go (the simulator decides when each kernel runs: `simulator.Simulator.differentiate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from memory_saving_gradients._src.analysis import gradient_uses
from memory_saving_gradients._src.planning.simulation.ledger import Buffer, Ledger


@dataclasses.dataclass(slots=True)
class GradientRun:
    """An op's gradient while its kernels run (`simulator.Simulator.differentiate`).

    Attributes:
      op: the op's position.
      incoming: the gradients of its outputs (None where one gets none).
      spent: what it lets go when its last kernel finishes: what it read for the last time
        and the gradients it received.
      read_by: what it read for the last time that only some of its kernels read, each with
        those of them not finished yet: let go as the last of them finishes (a matrix
        product's input, once the weight gradient reading it has run).
      kernels_left: its kernels not finished yet.
      dying: the ids of the buffers it reads for the last time, which a step may write into.
      wanted: for each input, whether it makes that input's gradient (none where no gradient
        arrives).
      value: the buffer of each tensor of its gradient function read or made so far.
      readers: the steps still to read each tensor of the function.
      made: the tensors of the function made so far.
      ran: the steps run so far (shared by two kernels: shapes, views).
      returned: the tensors holding the wanted gradients.
      given: those of `returned` whose own hold is given up to the parts made of them.
      working: the most bytes the kernels of its steps hold for themselves at once.
      scratch_counted: whether its measured scratch was counted (`OpCost.gradient_working`).
      received: the inputs each kernel made a gradient part for, by the kernel's index.
    """

    op: int
    incoming: list[Buffer | None]
    spent: list[Buffer]
    kernels_left: int
    dying: set[int]
    read_by: list[tuple[Buffer, set[int]]] = dataclasses.field(default_factory=list)
    wanted: list[bool] = dataclasses.field(default_factory=list)
    value: dict[int, Buffer] = dataclasses.field(default_factory=dict)
    readers: dict[int, int] = dataclasses.field(default_factory=dict)
    made: set[int] = dataclasses.field(default_factory=set)
    ran: set[int] = dataclasses.field(default_factory=set)
    returned: frozenset[int] = frozenset()
    given: set[int] = dataclasses.field(default_factory=set)
    working: int = 0
    scratch_counted: bool = False
    received: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def needed_steps(
    use: gradient_uses.GradientUse, wanted: Sequence[bool]
) -> tuple[dict[int, int], frozenset[int], int]:
    """For the steps of `use` that the `wanted` input gradients need: how many of them read
    each tensor, the tensors holding the wanted gradients, and their kernels' own buffers."""
    needed = frozenset().union(*(n for n, want in zip(use.needs, wanted, strict=True) if want))
    readers: dict[int, int] = {}
    for index in needed:
        for t in use.steps[index].reads:
            readers[t] = readers.get(t, 0) + 1
    returned = frozenset(
        r for r, want in zip(use.returned, wanted, strict=True) if want and r is not None
    )
    return readers, returned, sum(use.steps[index].working for index in needed)


def run_steps(
    ledger: Ledger,
    gradient: GradientRun,
    use: gradient_uses.GradientUse,
    group: Sequence[int],
    steps: Sequence[int],
    *,
    count_step_scratch: bool,
    side_by_side: bool,
) -> dict[int, Buffer | None]:
    """Run those of `steps` (the steps of `use` that the gradients of the inputs `group`
    need, in order) that no other kernel of `gradient` ran; return a held buffer for each of
    those inputs' gradients (None where it has none). An element-wise step may write into a
    buffer nothing else needs: a temporary it reads for the last time, the arriving
    gradient, or what backprop reads for the last time here (`GradientRun.dying`). A step
    reading only constants (the folded seed of the ys, static shapes) is folded too. Each
    step's kernel scratch is counted where `count_step_scratch` (not measured for the whole
    gradient), all of the gradient's at once where its kernels run `side_by_side`."""
    value, readers, made, returned = (
        gradient.value,
        gradient.readers,
        gradient.made,
        gradient.returned,
    )
    for index in steps:
        if index in gradient.ran:
            continue
        gradient.ran.add(index)
        step = use.steps[index]
        reads = [value.get(t) or Buffer(0, constant=True) for t in step.reads]
        folded = step.folded or all(b.constant for b in reads)
        free = [
            b
            for t, b in zip(step.reads, reads, strict=True)
            if readers[t] == 1
            and b.holders == 1
            and not b.constant
            and (t in made or id(b) in gradient.dying or b in gradient.incoming)
        ]
        for t, size in zip(step.outputs, step.sizes, strict=True):
            if folded:
                buffer = Buffer(0, constant=True)
            elif step.aliases:
                buffer = ledger.hold(reads[0])
            elif step.reuses_input and (taken := next((b for b in free if b.size == size), None)):
                free.remove(taken)
                buffer = ledger.hold(taken)
            else:
                buffer = ledger.new(size)
            value[t] = buffer
            made.add(t)
        if step.working and not folded and count_step_scratch:
            ledger.working(gradient.working if side_by_side else step.working)
        for t in step.outputs:
            if t not in readers and t not in returned:
                ledger.release(value[t])
        for t in step.reads:
            readers[t] -= 1
            if readers[t] == 0 and t in made and t not in returned:
                ledger.release(value[t])
    gradients: dict[int, Buffer | None] = {}
    for i in group:
        r = use.returned[i]
        gradients[i] = None if r is None else ledger.hold(value.get(r) or Buffer(0, constant=True))
        if r in made and r not in gradient.given:
            gradient.given.add(r)
            ledger.release(value[r])
    return gradients
