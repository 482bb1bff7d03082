"""The order in which TensorFlow's executor runs the gradients of a backward pass.

With one inter-op thread, the gradients run one at a time, from the last op to the first,
and an op's kernels from its last to its first: the executor runs the last kernel made ready
inline and queues the others (a matrix product's weight gradient before its data gradient).
With more, every gradient kernel whose incoming gradients are complete is ready: a thread
that finishes one goes on with a kernel that one made ready (the executor runs the last of
them inline), and the others queue for the next free thread. So the gradients of independent
branches (the gradients of two branches meeting in an add) run side by side, each holding
what it made and what it reads until it finishes: more at once on two threads than on one,
as tests/test_simulation.py measures in Sessions.

An op's gradient is one or more kernels that run apart (a convolution's input gradient and
its filter gradient): the gradient of what the op read goes on as soon as the kernel making
it finishes, while a slower one still runs and holds what it reads (MobileNetV2 under
mixed_float16 on CPU: a depthwise convolution's float16 filter gradient still held its
padded input while the batch norm before it was differentiated).

Nothing here knows TensorFlow or buffers: ops are integers, and the simulator allocates as
each kernel starts and releases as the last of an op's kernels finishes.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Mapping, Sequence
from typing import NamedTuple

#: One of an op's gradient's kernels (by index) starting (True) or finishing (False).
Event = tuple[int, int, bool]


class Kernel(NamedTuple):
    """Kernels of an op's gradient that run together, apart from its others.

    Attributes:
      seconds: how long they run, in any unit the same for all.
      makers: the ops making the inputs whose gradients they make, once for each such
        input: those ops' gradients wait for them.
      after: the op's other kernels (by index) these start after.
    """

    seconds: float
    makers: Sequence[int]
    after: Sequence[int] = ()


def backward_events(
    ops: Sequence[int],
    kernels: Mapping[int, Sequence[Kernel]] | Sequence[Sequence[Kernel]],
    threads: int,
) -> list[Event]:
    """When the `kernels` of the gradients of `ops` (in topological order; `kernels[op]`)
    start and finish, in order. Makers that are not among `ops` are differentiated
    elsewhere, and nothing here waits for them."""
    if threads <= 1:
        return [
            (op, index, starts)
            for op in reversed(ops)
            for index in _in_turn(kernels[op])
            for starts in (True, False)
        ]
    waiting = dict.fromkeys(ops, 0)
    for op in ops:
        for kernel in kernels[op]:
            for maker in kernel.makers:
                if maker in waiting:
                    waiting[maker] += 1
    # The latest op first: one thread runs the executor's ready ops in the order the
    # gradient function made them, which is from the ys back.
    held = {
        (op, index): len(kernel.after)
        for op in ops
        for index, kernel in enumerate(kernels[op])
        if kernel.after
    }
    queue = collections.deque(
        (op, index)
        for op in reversed(ops)
        if not waiting[op]
        for index in range(len(kernels[op]))
        if (op, index) not in held
    )
    idle = list(range(threads))
    running: list[tuple[float, int, int, int, int]] = []  # (finish, tiebreak, thread, op, kernel)
    events: list[Event] = []
    now = 0.0

    def start(op: int, index: int, thread: int) -> None:
        events.append((op, index, True))
        heapq.heappush(running, (now + kernels[op][index].seconds, len(events), thread, op, index))

    while queue or running:
        while idle and queue:
            start(*queue.popleft(), idle.pop())
        if not running:
            break
        now, _, thread, op, index = heapq.heappop(running)
        events.append((op, index, False))
        for sibling, kernel in enumerate(kernels[op]):
            if index in kernel.after:
                held[op, sibling] -= 1
                if not held[op, sibling]:
                    queue.appendleft((op, sibling))
        ready = []
        for maker in kernels[op][index].makers:
            if maker in waiting:
                waiting[maker] -= 1
                if not waiting[maker]:
                    ready.append(maker)
        kernels_ready = [
            (maker, i)
            for maker in sorted(ready)
            for i in range(len(kernels[maker]))
            if (maker, i) not in held
        ]
        if kernels_ready:
            start(*kernels_ready.pop(), thread)
            queue.extend(reversed(kernels_ready))
        else:
            idle.append(thread)
    return events


def _in_turn(kernels: Sequence[Kernel]) -> list[int]:
    """The order one thread runs an op's kernels in: the last made first, as the executor
    runs the last made ready inline, each after the kernels it waits for."""
    order: list[int] = []
    pending = list(reversed(range(len(kernels))))
    while pending:
        index = next(i for i in pending if all(k in order for k in kernels[i].after))
        pending.remove(index)
        order.append(index)
    return order
