"""The order in which TensorFlow's executor runs the gradients of a backward pass.

With one inter-op thread, the gradients run one at a time, from the last op to the first.
With more, every gradient whose incoming gradients are complete is ready: a thread that
finishes one goes on with a gradient that one made ready (the executor runs the last of them
inline), and the others queue for the next free thread. So the gradients of independent
branches (the two products of a matmul's inputs, the gradients of two branches meeting in
an add) run side by side, each holding what it made and what it reads until it finishes.
Measured on two threads: two branches each differentiating a matmul hold 8 MB at once where
one thread holds 6 (tests/test_simulation.py).

Nothing here knows TensorFlow or buffers: ops are integers, and the simulator allocates at
each start and releases at each finish.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Mapping, Sequence

#: An op's gradient starting (True) or finishing (False).
Event = tuple[int, bool]


def backward_events(
    ops: Sequence[int],
    unblocks: Mapping[int, Sequence[int]],
    seconds: Sequence[float],
    threads: int,
) -> list[Event]:
    """When the gradients of `ops` (in topological order) start and finish, in order.

    `unblocks[op]` lists the ops whose gradients wait for `op`'s (those making what `op`
    reads), once for each such read; `seconds[op]` is how long its gradient runs, in any
    unit the same for all. One thread needs neither.
    """
    if threads <= 1:
        return [(op, starts) for op in reversed(ops) for starts in (True, False)]
    waiting = dict.fromkeys(ops, 0)
    for op in ops:
        for maker in unblocks[op]:
            waiting[maker] += 1
    # The latest op first: one thread runs the executor's ready ops in the order the
    # gradient function made them, which is from the ys back.
    queue = collections.deque(op for op in reversed(ops) if not waiting[op])
    idle = list(range(threads))
    running: list[tuple[float, int, int, int]] = []  # (finish, tiebreak, thread, op)
    events: list[Event] = []
    now = 0.0

    def start(op: int, thread: int) -> None:
        events.append((op, True))
        heapq.heappush(running, (now + seconds[op], len(events), thread, op))

    while queue or running:
        while idle and queue:
            start(queue.popleft(), idle.pop())
        if not running:
            break
        now, _, thread, op = heapq.heappop(running)
        events.append((op, False))
        ready = []
        for maker in unblocks[op]:
            waiting[maker] -= 1
            if not waiting[maker]:
                ready.append(maker)
        if ready:
            ready.sort()
            start(ready.pop(), thread)
            queue.extend(reversed(ready))
        else:
            idle.append(thread)
    return events
