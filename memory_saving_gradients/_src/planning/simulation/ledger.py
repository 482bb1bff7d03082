"""The buffers alive during a simulated step, their bytes, and the most alive at once.

A buffer may be shared by several holders (tensors aliasing one buffer, an output written
into an input's) and is freed when the last lets go. Tensors are known by integers and by
their copy level: recomputed copies get levels of their own, and look up what they read at
their level first, then at the levels they were copied from (`chain`, innermost first).
Nothing here knows TensorFlow or gradients: the simulator decides what is allocated and when
it is let go.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypeVar

#: The copy level of the tensors the forward pass computes.
ORIGINAL = 0


@dataclasses.dataclass(eq=False)
class Buffer:
    size: int
    holders: int = 1
    #: A value graph optimizers compute ahead of the step (it takes no step memory).
    constant: bool = False


#: A buffer, or None where a tensor has none; `hold` returns what it was given.
MaybeBuffer = TypeVar("MaybeBuffer", bound="Buffer | None")


class OverLimit(Exception):
    """The bytes alive passed the ledger's limit: the simulation stops there."""


class Ledger:
    """Buffers alive during one simulated step, and the largest total seen; where that passes
    `limit`, `OverLimit` is raised (a search that only asks whether a plan fits need not
    simulate the rest of its step)."""

    def __init__(self, limit: float = math.inf) -> None:
        self.alive = 0
        self.peak = 0
        self.limit = limit
        #: The buffer of each tensor at each copy level, by level.
        self.levels: list[dict[int, Buffer | None]] = [{}]

    def new_level(self) -> int:
        self.levels.append({})
        return len(self.levels) - 1

    def new(self, size: int) -> Buffer:
        self.alive += size
        self._reached(self.alive)
        return Buffer(size)

    def working(self, size: int) -> None:
        """A kernel's own buffers of `size` bytes, held only while it runs."""
        self._reached(self.alive + size)

    def _reached(self, alive: int) -> None:
        if alive > self.peak:
            self.peak = alive
            if alive > self.limit:
                raise OverLimit

    def hold(self, buffer: MaybeBuffer) -> MaybeBuffer:
        if buffer is not None:
            buffer.holders += 1
        return buffer

    def release(self, buffer: Buffer | None) -> None:
        if buffer is not None:
            buffer.holders -= 1
            if buffer.holders == 0:
                self.alive -= buffer.size

    def buffer(self, tensor: int, chain: Sequence[int]) -> Buffer | None:
        """The buffer of `tensor` at the first level of `chain` that has it."""
        for level in chain:
            at_level = self.levels[level]
            if tensor in at_level:
                return at_level[tensor]
        return None
