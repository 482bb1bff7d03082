"""What each forward op costs: the bytes of its outputs, its compute, what backprop keeps.

Bytes come from static shapes and dtypes; a dimension unknown until run time (usually the
batch) counts `UNKNOWN_DIM_SIZE`. Compute is counted in FLOPs for contractions (matmul,
convolution, einsum) and in output elements for everything else. What an op's gradient reads,
and the ops it runs to make its input gradients, come from TensorFlow's registered gradient
function, built once aside for each kind of op (`_tf.gradient_aside`);
where that cannot be done (function calls, control flow, custom gradients) the gradient is
taken to read every input and output and to make new input gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from memory_saving_gradients import _tf
from memory_saving_gradients.analysis import measured, queries

#: Elements assumed for a dimension whose static size is unknown (usually the batch).
UNKNOWN_DIM_SIZE = 64

#: Element-wise ops whose kernels write their output into an input buffer nothing else
#: needs any more (TensorFlow's `forward_input_or_allocate_output`), forward or backward.
REUSES_INPUT_BUFFER = frozenset(
    {
        "Abs", "Add", "AddN", "AddV2", "BiasAdd", "Ceil", "Cos", "Div", "DivNoNan", "Elu",
        "EluGrad", "Erf", "Exp", "Floor", "LeakyRelu", "LeakyReluGrad", "Log", "Log1p",
        "Maximum", "Minimum", "Mul", "MulNoNan", "Neg", "Pow", "RealDiv", "Reciprocal",
        "Relu", "Relu6", "Relu6Grad", "ReluGrad", "Round", "Rsqrt", "RsqrtGrad", "Selu",
        "SeluGrad", "Sigmoid", "SigmoidGrad", "Sign", "Sin", "Softplus", "SoftplusGrad",
        "Softsign", "Sqrt", "SqrtGrad", "Square", "SquaredDifference", "Sub", "Tanh",
        "TanhGrad",
    }
)  # fmt: skip
#: Ops whose output is their input's buffer: they allocate nothing.
ALIASING = frozenset(
    {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "Snapshot"}
)
#: Ops whose outputs are resident before a step runs (variables' buffers, constants).
RESIDENT = frozenset({"Const", "ReadVariableOp", "VarHandleOp", "Placeholder"})


def num_elements(tensor: tf.Tensor) -> int:
    """Elements in `tensor` by its static shape; unknown dimensions count `UNKNOWN_DIM_SIZE`."""
    shape = queries.static_shape(tensor)
    if shape is None:
        return UNKNOWN_DIM_SIZE
    return math.prod(_known(d) for d in shape)


def tensor_bytes(tensor: tf.Tensor) -> int:
    """Bytes `tensor` occupies by its static shape (resources and variants count 8 bytes)."""
    dtype = tensor.dtype.base_dtype
    itemsize = 8 if dtype in (tf.resource, tf.variant, tf.string) else dtype.size
    return num_elements(tensor) * itemsize


#: Matrix products, batched or not.
MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
#: Contractions: each output element sums products over an inner dimension or a window.
CONTRACTIONS = MATMULS | {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "Einsum"}


def runs_cpu_kernels(op: tf.Operation) -> bool:
    """Whether `op` runs on TensorFlow's own CPU kernels: placed on a CPU, or unplaced where
    no GPU is visible, and not compiled by XLA."""
    if _tf.compiled_by_xla(op.graph):
        return False
    device_type = tf.DeviceSpec.from_string(op.device).device_type if op.device else None
    # Visible devices are read without starting TensorFlow's runtime, which would freeze
    # the user's thread and device settings.
    return device_type == "CPU" if device_type else not tf.config.get_visible_devices("GPU")


def inter_op_threads() -> int:
    """Threads of the executor's inter-op pool: as configured, else one per core. A
    Session's own thread pool is not seen."""
    return tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count() or 1


def working_bytes(
    op_type: str,
    inputs: Sequence[tuple[tf.DType, int]],
    output_bytes: Sequence[int],
    before_bias_add: bool = False,
) -> int:
    """Bytes an op's TensorFlow CPU kernel allocates for itself while it runs, beyond its
    outputs, given the dtype and bytes of each input, the bytes of each output, and whether a
    BiasAdd alone reads its output. Where oneDNN does not compute in float16 on this CPU
    (`float16_matmuls_native`), a float16 matmul computes in float32: it holds a float32 copy
    of each operand and of its result (measured on TensorFlow 2.21: a [2048, 512] by
    [512, 1024] MatMul holds 14 MiB beside its 4 MiB output). bfloat16 runs natively in
    oneDNN, but on a CPU without AMX a MatMul fused with the BiasAdd after it (grappler's
    remapper) holds its result in float32 (measured on one without AMX; on a Sapphire Rapids,
    with it, the same fused MatMul holds nothing more). Other kernels' scratch space is not
    counted: float16 convolution gradients on CPU hold some 25-32 MiB, whatever their shapes."""
    if op_type not in MATMULS or not inputs:
        return 0
    if inputs[0][0] == tf.float16 and not float16_matmuls_native():
        return 2 * (sum(size for _, size in inputs) + sum(output_bytes))
    if (
        inputs[0][0] == tf.bfloat16
        and op_type == "MatMul"
        and before_bias_add
        and "amx_bf16" not in _cpu_flags()
    ):
        return 2 * sum(output_bytes)
    return 0


@functools.cache
def float16_matmuls_native() -> bool:
    """Whether TensorFlow's CPU matmuls compute float16 in float16 here: where oneDNN is on and
    the CPU has what TensorFlow asks of it for float16 (AVX512_FP16 or AMX_FP16 beside
    AVX512BW, or AVX_NE_CONVERT: `IsDataTypeSupportedByOneDNNOnThisCPU`), grappler hands them
    to oneDNN; elsewhere Eigen's kernel computes in float32."""
    flags = _cpu_flags()
    return _tf.onednn_enabled() and (
        ("avx512bw" in flags and bool({"avx512_fp16", "amx_fp16"} & flags))
        or "avx_ne_convert" in flags
    )


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them in /proc/cpuinfo; none where it has no such
    file (the model then assumes the older CPUs' kernels)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


#: Ops whose output is the shape of their input: a constant where that shape is static.
SHAPE_OF = frozenset({"Shape", "ShapeN", "Size", "Rank"})
#: Ops that read only the shape of a tensor, which does not keep it alive for backprop.
SHAPE_READERS = SHAPE_OF | {"BroadcastGradientArgs"}


@dataclasses.dataclass(frozen=True)
class GradientStep:
    """One op of a gradient function built aside, as the executor runs it.

    Attributes:
      name: its name in the function, which is its name in backprop's scope for the op
        (`gradients/<op>_grad/<name>`): what a profiled step's kernels are matched by.
      outputs: ids of its output tensors.
      sizes: bytes of each output.
      reads: ids of the tensors it reads (those made outside the function at run time: the
        output gradients and the forward tensors it captures; and earlier steps' outputs).
      aliases: its output is its first input's buffer (reshapes, identities).
      folded: it gives a shape that is static, so graph optimizers compute it ahead.
      reuses_input: its output may take over an input buffer nothing else needs.
      working: bytes its kernel holds for itself while it runs (`working_bytes`).
    """

    name: str
    outputs: tuple[int, ...]
    sizes: tuple[int, ...]
    reads: tuple[int, ...]
    aliases: bool
    folded: bool
    reuses_input: bool
    working: int

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


#: What each kind of op's gradient reads and makes, for at most `KINDS_KEPT` kinds (a
#: long-running process builds ever new ones); the oldest goes first.
_GRADIENT_USES: dict[tuple, GradientUse | None] = {}
KINDS_KEPT = 4096


def gradient_use(op: tf.Operation) -> GradientUse | None:
    """What `op`'s registered gradient reads and makes (None where unknown), found once for
    each kind of op: type, attributes, input dtypes and shapes, and whether it runs on CPU
    kernels."""
    attrs = op.node_def.attr  # the NodeDef is serialized on each access
    cpu = runs_cpu_kernels(op)
    key = (
        op.type,
        tuple((k, attrs[k].SerializeToString()) for k in sorted(attrs)),
        tuple((t.dtype, queries.static_shape(t)) for t in op.inputs),
        cpu,
    )
    if key not in _GRADIENT_USES:
        if len(_GRADIENT_USES) >= KINDS_KEPT:
            del _GRADIENT_USES[next(iter(_GRADIENT_USES))]
        aside = _tf.gradient_aside(op)
        _GRADIENT_USES[key] = None if aside is None else _gradient_use(op, aside, cpu)
    return _GRADIENT_USES[key]


def _gradient_use(op: tf.Operation, aside: _tf.GradientAside, cpu: bool) -> GradientUse:
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
        shape_read = body_op.type in SHAPE_READERS
        step_of[body_op] = len(steps)
        sizes = tuple(0 if shape_read else _step_bytes(t, size_of) for t in body_op.outputs)
        working = 0
        if cpu and body_op.type in MATMULS:
            read = [(t.dtype, size_of.get(id(t), tensor_bytes(t))) for t in body_op.inputs]
            working = working_bytes(body_op.type, read, sizes)
        steps.append(
            GradientStep(
                name=body_op.name,
                outputs=tuple(id(t) for t in body_op.outputs),
                sizes=sizes,
                reads=tuple(id(t) for t in body_op.inputs if id(t) in runtime),
                aliases=body_op.type in ALIASING,
                folded=body_op.type in SHAPE_OF
                and all(t.shape.is_fully_defined() for t in body_op.inputs),
                reuses_input=body_op.type in REUSES_INPUT_BUFFER,
                working=working,
            )
        )
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
            if body_op.type in SHAPE_READERS:
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
        return tensor_bytes(tensor)
    read = [
        size_of.get(id(t), tensor_bytes(t)) // max(t.dtype.size, 1)
        for t in tensor.op.inputs
        if id(t) in size_of or (t.shape.is_fully_defined() and t.dtype.is_floating)
    ]
    size = max(read) * tensor.dtype.size if read else tensor_bytes(tensor)
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


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What one forward op costs.

    Attributes:
      output_bytes: bytes each output allocates (0 for aliases and resident values).
      saved_inputs, saved_outputs: indices of the inputs and outputs its gradient reads.
      needed: for each input, whether backprop computes its gradient.
      gradient: what its registered gradient function reads and makes, step by step; None
        where unknown (function calls, control flow, custom gradients): such a gradient is
        taken to read every input and output and to make new input gradients.
      reuses_input: whether its output may take over an input buffer nothing else needs.
      aliases: its outputs are its first input's buffer (reshapes, identities).
      working: bytes its kernel holds for itself while it runs (`working_bytes`, or
        measured).
      flops: its compute.
      seconds: its kernel's measured time; None where costs are static.
      gradient_seconds: its gradient's kernels' measured time; None where costs are static.
      gradient_kernel_seconds: (name, seconds) of each of its gradient's kernels measured,
        by its name in the gradient function (`GradientStep.name`).
      gradient_working: the most bytes its gradient's kernels held for themselves at once,
        measured (`measured.OpMeasurement.gradient_scratch_at_once`); None where costs are
        static (each gradient step's `working` counts instead).
    """

    output_bytes: tuple[int, ...]
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    needed: tuple[bool, ...]
    gradient: GradientUse | None
    reuses_input: bool
    aliases: bool
    working: int
    flops: float
    seconds: float | None = None
    gradient_seconds: float | None = None
    gradient_kernel_seconds: tuple[tuple[str, float], ...] = ()
    gradient_working: int | None = None

    @property
    def compute(self) -> float:
        """What recomputing it costs: its measured seconds, or its FLOPs where costs are
        static. The ops of one view are all measured or none is."""
        return self.flops if self.seconds is None else self.seconds


def needed_inputs(op: tf.Operation, needs_gradient: Callable[[tf.Tensor], bool]) -> tuple:
    """For each input of `op`, whether backprop computes its gradient."""
    return tuple(needs_gradient(t) and _tf.is_differentiable(t) for t in op.inputs)


def op_cost(op: tf.Operation, needs_gradient: Callable[[tf.Tensor], bool]) -> OpCost:
    """The cost of `op` in the forward pass, and what computing the gradients of its inputs
    for which `needs_gradient` holds keeps and allocates."""
    needed = needed_inputs(op, needs_gradient)
    use = gradient_use(op)
    free = op.type in ALIASING or op.type in RESIDENT
    if use is None:
        saved_inputs, saved_outputs = list(range(len(op.inputs))), list(range(len(op.outputs)))
    else:
        wanted = [r for r, want in zip(use.reads, needed, strict=True) if want]
        saved_inputs = sorted(set().union(*(r[0] for r in wanted)))
        saved_outputs = sorted(set().union(*(r[1] for r in wanted)))
    output_bytes = tuple(0 if free else tensor_bytes(t) for t in op.outputs)
    return OpCost(
        output_bytes=output_bytes,
        saved_inputs=tuple(saved_inputs),
        saved_outputs=tuple(saved_outputs),
        needed=tuple(needed),
        gradient=use,
        reuses_input=op.type in REUSES_INPUT_BUFFER,
        aliases=op.type in ALIASING,
        working=_working_bytes(op, output_bytes),
        flops=flops(op),
    )


def measured_cost(cost: OpCost, measurement: measured.OpMeasurement | None) -> OpCost:
    """`cost` with its kernels' scratch and time as measured; an op the profile does not
    show (folded, pruned, fused into another op, which carries the fused kernel's costs)
    measured nothing."""
    if measurement is None:
        measurement = measured.OpMeasurement(0.0, 0, 0.0, ())
    return dataclasses.replace(
        cost,
        working=measurement.scratch_bytes,
        seconds=measurement.seconds,
        gradient_seconds=measurement.gradient_seconds,
        gradient_kernel_seconds=tuple(sorted(measurement.gradient_kernel_seconds.items())),
        gradient_working=measurement.gradient_scratch_at_once(inter_op_threads()),
    )


def _working_bytes(op: tf.Operation, output_bytes: Sequence[int]) -> int:
    if op.type not in MATMULS or not runs_cpu_kernels(op):
        return 0
    return working_bytes(
        op.type,
        [(t.dtype, tensor_bytes(t)) for t in op.inputs],
        output_bytes,
        before_bias_add=[c.type for c in op.outputs[0].consumers()] == ["BiasAdd"],
    )


#: Ops that reduce their first input: each reads all of it for a small output.
REDUCTIONS = frozenset({"Mean", "Sum", "Max", "Min", "Prod", "EuclideanNorm", "ArgMax", "ArgMin"})


def flops(op: tf.Operation) -> float:
    """Floating-point operations of `op`: multiply-adds count two."""
    if not op.outputs:
        return 0.0
    out = num_elements(op.outputs[0])
    if op.type in MATMULS:
        a = op.inputs[0]
        transposed = op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x")
        inner = _dim(a, -2 if transposed else -1)
        return 2.0 * out * inner
    if op.type in ("Conv2D", "Conv3D", "DepthwiseConv2dNative"):
        kernel = queries.static_shape(op.inputs[1]) or (None, None, None)
        window = math.prod(_known(d) for d in kernel[:-2])
        per_output = window if op.type == "DepthwiseConv2dNative" else window * _known(kernel[-2])
        return 2.0 * out * per_output
    if op.type in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):
        kernel = queries.static_shape(op.inputs[1]) or (None, None)
        return 2.0 * num_elements(op.inputs[2]) * math.prod(_known(d) for d in kernel[:-1])
    if op.type == "Einsum":
        return 2.0 * _einsum_terms(op)
    if op.type in REDUCTIONS and op.inputs:  # a pass over all of its input
        return float(max(out, num_elements(op.inputs[0])))
    return float(out)


def _einsum_terms(op: tf.Operation) -> float:
    """Products an Einsum forms: the product of the sizes of all its distinct indices."""
    equation = op.get_attr("equation").decode()
    operands = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, tensor in zip(operands, op.inputs, strict=False):
        shape = queries.static_shape(tensor) or ()
        if "." in letters or len(letters) != len(shape):
            return float(num_elements(op.outputs[0]))
        sizes.update((letter, _known(d)) for letter, d in zip(letters, shape, strict=True))
    return float(np.prod(list(sizes.values()), dtype=np.float64))


def _dim(tensor: tf.Tensor, axis: int) -> int:
    shape = queries.static_shape(tensor)
    return UNKNOWN_DIM_SIZE if shape is None else _known(shape[axis])


def _known(dim: int | None) -> int:
    return UNKNOWN_DIM_SIZE if dim is None else dim
