"""What an op's gradient function reads and makes, step by step.

The gradient function for each kind of op (TensorFlow's registered one, or the library's own
where it has one: `gradient_functions`) is built once aside (`_tf.gradient_aside`),
on placeholders standing for the op's tensors and its output gradients. Its ops computed at
run time are the steps the executor runs: what each reads, makes and holds, and which steps
each input's gradient needs, so the simulator can replay them kernel by kernel and the cost
model can tell which of the op's tensors backprop keeps. Where it cannot be built (function
calls, control flow, custom gradients) nothing is known (`gradient_use` gives None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import gradient_functions, kernels, queries


@dataclasses.dataclass(frozen=True)
class GradientStep:
    """One op of a gradient function built aside, as the executor runs it.

    Attributes:
      name: its name in the function, which is its name in backprop's scope for the op
        (`gradients/<op>_grad/<name>`): what a profiled step's kernels are matched by.
      kind: its op's type.
      outputs: ids of its output tensors.
      sizes: bytes of each output.
      reads: ids of the tensors it reads (those made outside the function at run time: the
        output gradients and the forward tensors it captures; and earlier steps' outputs).
      aliases: its output is its first input's buffer (reshapes, identities).
      folded: it gives a shape that is static, so graph optimizers compute it ahead.
      reuses_input: its output may take over an input buffer nothing else needs.
      working: bytes its kernel holds for itself while it runs (`working_bytes`).
      waits: the steps it waits for besides those it reads, made before or after it (control
        inputs: NOTE [a product's gradient frees before it makes] in gradient_functions.py).
    """

    name: str
    kind: str
    outputs: tuple[int, ...]
    sizes: tuple[int, ...]
    reads: tuple[int, ...]
    aliases: bool
    folded: bool
    reuses_input: bool
    working: int
    waits: tuple[int, ...]

    @property
    def computes(self) -> bool:
        """Whether its kernel computes values, rather than a shape or a view of its input."""
        return not (self.aliases or self.folded) and any(self.sizes)


@dataclasses.dataclass(frozen=True)
class GradientUse:
    """What an op's registered gradient function reads and makes, step by step.

    Attributes:
      reads: for each input, the (inputs, outputs) of the op, by index, that computing that
        input's gradient reads beyond their shape; backprop holds them until it has run.
      seeds: for each output of the op, the id of the placeholder standing for its gradient
        (None for outputs that take none).
      captured: (id, "in" or "out", index) of the placeholder standing for each of the op's
        tensors the function reads.
      needs: for each input, the indices of the steps its gradient needs.
      steps: the function's ops computed at run time, in the order they were made (those
        computed from constants alone are left out: graph optimizers fold them).
      returned: for each input, the id of the tensor holding its gradient's values (None
        where it has none).
    """

    reads: tuple[tuple[frozenset[int], frozenset[int]], ...]
    seeds: tuple[int | None, ...]
    captured: tuple[tuple[int, str, int], ...]
    needs: tuple[frozenset[int], ...]
    steps: tuple[GradientStep, ...]
    returned: tuple[int | None, ...]

    def kernels(self, wanted: Sequence[bool]) -> tuple[tuple[int, ...], ...]:
        """The `wanted` inputs grouped by the kernels making their gradients: two inputs share
        a group where their gradients need a common step that computes something (not a
        shape, not a reshape). The executor runs each group's kernels as soon as the
        gradients arrive, independently of the others' (a convolution's input and filter
        gradients), and each group's gradients are ready as its own kernels finish."""
        groups: list[tuple[set[int], set[int]]] = []  # (inputs, their computing steps)
        for index, want in enumerate(wanted):
            if not want:
                continue
            inputs, computing = {index}, {s for s in self.needs[index] if self.steps[s].computes}
            apart = []
            for group in groups:
                if group[1] & computing:
                    inputs |= group[0]
                    computing |= group[1]
                else:
                    apart.append(group)
            groups = [*apart, (inputs, computing)]
        return tuple(
            tuple(sorted(inputs)) for inputs, _ in sorted(groups, key=lambda g: min(g[0]))
        )

    def kernels_waited_for(self, groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """For each of the kernel `groups` (`kernels`), the other groups it waits for: those
        whose steps its own steps wait on besides reading them (`GradientStep.waits`)."""
        steps = [set().union(*(self.needs[i] for i in group)) for group in groups]
        waited = [set().union(*(self.steps[s].waits for s in own)) - own for own in steps]
        return tuple(
            tuple(k for k, other in enumerate(steps) if k != g and waited[g] & other)
            for g in range(len(groups))
        )


#: What each kind of op's gradient reads and makes, for at most `KINDS_KEPT` kinds (a
#: long-running process builds ever new ones); the oldest goes first.
_GRADIENT_USES: dict[tuple, GradientUse | None] = {}
KINDS_KEPT = 4096


def gradient_use(op: tf.Operation, registered: bool = False) -> GradientUse | None:
    """What the gradient the library's backprop builds for `op` reads and makes (its own
    function where it has one, `gradient_functions.replacing`), or, `registered`, what
    TensorFlow's registered gradient does (as `tf.gradients` builds it); None where unknown.
    Found once for each kind of op: type, attributes, input dtypes and shapes, which inputs
    are one tensor (`x * x` reads one placeholder for both), whether it runs on CPU kernels,
    and which function differentiates it."""
    function = None if registered else gradient_functions.replacing(op)
    attrs = op.node_def.attr  # the NodeDef is serialized on each access
    cpu, xla = kernels.runs_cpu_kernels(op), _tf.compiled_by_xla(op.graph)
    inputs = list(op.inputs)
    key = (
        op.type,
        tuple((k, attrs[k].SerializeToString()) for k in sorted(attrs)),
        tuple((t.dtype, queries.static_shape(t)) for t in inputs),
        tuple(next(j for j, u in enumerate(inputs) if u is t) for t in inputs),
        cpu,
        xla,
        function,
    )
    if key not in _GRADIENT_USES:
        if len(_GRADIENT_USES) >= KINDS_KEPT:
            del _GRADIENT_USES[next(iter(_GRADIENT_USES))]
        aside = _tf.gradient_aside(op, function)
        _GRADIENT_USES[key] = None if aside is None else _gradient_use(op, aside, cpu, xla)
    return _GRADIENT_USES[key]


def _gradient_use(op: tf.Operation, aside: _tf.GradientAside, cpu: bool, xla: bool) -> GradientUse:
    ops = aside.graph.get_operations()
    runtime: set[int] = {id(g) for g in aside.output_gradients if g is not None}
    runtime.update(id(inner) for inner in aside.read.values())
    steps: list[GradientStep] = []
    step_of: dict[tf.Operation, int] = {}
    size_of: dict[int, int] = {}  # bytes of the runtime tensors whose shapes tracing left open
    for body_op in ops:
        if body_op.type == "Placeholder" or not any(id(t) in runtime for t in body_op.inputs):
            continue
        runtime.update(id(t) for t in body_op.outputs)
        shape_read = body_op.type in kernels.SHAPE_READERS
        step_of[body_op] = len(steps)
        sizes = tuple(0 if shape_read else _step_bytes(t, size_of) for t in body_op.outputs)
        working = 0
        read = [(t.dtype, size_of.get(id(t), kernels.tensor_bytes(t))) for t in body_op.inputs]
        if cpu and body_op.type in kernels.MATMULS:
            working = kernels.working_bytes(body_op.type, read, sizes)
        elif body_op.type == "Einsum" and not xla:
            working = kernels.einsum_working_bytes(body_op, [b for _, b in read], sizes[0])
        steps.append(
            GradientStep(
                name=body_op.name,
                kind=body_op.type,
                outputs=tuple(id(t) for t in body_op.outputs),
                sizes=sizes,
                reads=tuple(id(t) for t in body_op.inputs if id(t) in runtime),
                aliases=body_op.type in kernels.ALIASING
                or kernels.slices_its_input_buffer(body_op),
                folded=body_op.type in kernels.SHAPE_OF
                and all(t.shape.is_fully_defined() for t in body_op.inputs),
                reuses_input=body_op.type in kernels.REUSES_INPUT_BUFFER,
                working=working,
                waits=(),
            )
        )
    # A step may wait for one made after it (NOTE [a product's gradient frees before it makes]).
    steps = [
        dataclasses.replace(
            step, waits=tuple(step_of[c] for c in body_op.control_inputs if c in step_of)
        )
        for step, body_op in zip(steps, step_of, strict=True)
    ]
    captured = tuple(
        (id(inner), kind, index) for (kind, index), inner in _outer_and_inner(op, aside)
    )
    placeholder_of = {inner: (kind, index) for inner, kind, index in captured}
    reads, needs, returned = [], [], []
    for gradient in aside.input_gradients:
        tensors = [] if gradient is None else tf.nest.flatten(gradient, expand_composites=True)
        ancestors = _ancestors([t.op for t in tensors], within=step_of)
        needs.append(frozenset(step_of[a] for a in ancestors))
        read_inputs: set[int] = set()
        read_outputs: set[int] = set()
        for body_op in ancestors:
            if body_op.type in kernels.SHAPE_READERS:
                continue
            for t in body_op.inputs:
                outer = placeholder_of.get(id(t))
                if outer is not None:
                    (read_inputs if outer[0] == "in" else read_outputs).add(outer[1])
        reads.append((frozenset(read_inputs), frozenset(read_outputs)))
        values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
        returned.append(None if gradient is None else id(values))
    seeds = tuple(None if g is None else id(g) for g in aside.output_gradients)
    return GradientUse(tuple(reads), seeds, captured, tuple(needs), tuple(steps), tuple(returned))


def _step_bytes(tensor: tf.Tensor, size_of: dict[int, int]) -> int:
    """Bytes a gradient step's output takes. Where tracing left its shape open (a transpose by
    a computed permutation), it is taken to be as large as the largest runtime tensor the step
    reads, as a gradient's steps move, reshape and combine what they read: counting each open
    dimension as `UNKNOWN_DIM_SIZE` made a 4-d transpose 64**4 elements. `size_of` keeps the
    bytes found for open shapes, for the steps that read them."""
    if tensor.shape.is_fully_defined():
        return kernels.tensor_bytes(tensor)
    read = [
        size_of.get(id(t), kernels.tensor_bytes(t)) // max(t.dtype.size, 1)
        for t in tensor.op.inputs
        if id(t) in size_of or (t.shape.is_fully_defined() and t.dtype.is_floating)
    ]
    size = max(read) * tensor.dtype.size if read else kernels.tensor_bytes(tensor)
    size_of[id(tensor)] = size
    return size


def _outer_and_inner(op: tf.Operation, aside: _tf.GradientAside):
    """(("in" or "out", index), placeholder) for each of `op`'s tensors the function reads."""
    for kind, tensors in (("in", op.inputs), ("out", op.outputs)):
        for index, t in enumerate(tensors):
            if id(t) in aside.read:
                yield (kind, index), aside.read[id(t)]


def _ancestors(ops, within) -> set:
    seen, stack = set(), [op for op in ops if op in within]
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(t.op for t in op.inputs if t.op in within)
    return seen
