"""How TensorFlow's kernels use memory: what a tensor occupies, which kernels allocate nothing
or write into an input buffer, what CPU kernels hold for themselves, how many run at once.

Bytes come from static shapes and dtypes; a dimension unknown until run time (usually the
batch) counts `UNKNOWN_DIM_SIZE`. The op kinds listed here are those whose kernels behave
differently from "allocate each output, hold nothing else"; what is not listed is taken to do
that, and a measured profile (`measured`) corrects it.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import queries

#: Elements assumed for a dimension whose static size is unknown (usually the batch).
UNKNOWN_DIM_SIZE = 64

#: Ops whose kernels write their output into an input buffer of its size that nothing else
#: needs any more (TensorFlow's `forward_input_or_allocate_output`), forward or backward:
#: element-wise ops, selects (the value taken where the condition holds, or the other) and
#: softmaxes.
REUSES_INPUT_BUFFER = frozenset(
    {
        "Abs", "Add", "AddN", "AddV2", "BiasAdd", "Ceil", "Cos", "Div", "DivNoNan", "Elu",
        "EluGrad", "Erf", "Exp", "Floor", "LeakyRelu", "LeakyReluGrad", "Log", "Log1p",
        "LogSoftmax", "Maximum", "Minimum", "Mul", "MulNoNan", "Neg", "Pow", "RealDiv",
        "Reciprocal", "Relu", "Relu6", "Relu6Grad", "ReluGrad", "Round", "Rsqrt", "RsqrtGrad",
        "Select", "SelectV2", "Selu", "SeluGrad", "Sigmoid", "SigmoidGrad", "Sign", "Sin",
        "Softmax", "Softplus", "SoftplusGrad", "Softsign", "Sqrt", "SqrtGrad", "Square",
        "SquaredDifference", "Sub", "Tanh", "TanhGrad",
    }
)  # fmt: skip
#: Ops whose output is their input's buffer: they allocate nothing.
ALIASING = frozenset(
    {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "Snapshot"}
)
#: The alignment TensorFlow's kernels require of a buffer they share (`EIGEN_MAX_ALIGN_BYTES`
#: of builds for AVX-512; a multiple of other builds').
ALIGNMENT_BYTES = 64


def slices_its_input_buffer(op: tf.Operation) -> bool:
    """Whether `op` is a strided slice whose kernel shares its input's buffer rather than
    copying: a contiguous range of a one-dimensional tensor, both of whose ends lie on the
    alignment (TensorFlow's `IsDim0SliceAligned`), by static bounds."""
    if op.type != "StridedSlice" or op.inputs[0].shape.rank != 1:
        return False
    if any(op.get_attr(mask) for mask in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask")):
        return False
    begin, end, strides = (tf.get_static_value(t) for t in op.inputs[1:4])
    size = op.inputs[0].shape[0]
    if begin is None or end is None or strides is None or list(strides) != [1] or size is None:
        return False
    start = 0 if op.get_attr("begin_mask") & 1 else _clamped_index(int(begin[0]), size)
    stop = size if op.get_attr("end_mask") & 1 else _clamped_index(int(end[0]), size)
    itemsize = op.inputs[0].dtype.size
    return (start * itemsize) % ALIGNMENT_BYTES == 0 and (stop * itemsize) % ALIGNMENT_BYTES == 0


def _clamped_index(index: int, size: int) -> int:
    """A slice bound as Python reads it: counted from the end where negative, within 0..size."""
    return min(max(index + size if index < 0 else index, 0), size)


#: Ops whose outputs are resident before a step runs (variables' buffers, constants).
RESIDENT = frozenset({"Const", "ReadVariableOp", "VarHandleOp", "Placeholder"})


#: Ops whose output has no more elements than their first input.
REDUCTIONS = frozenset({"Mean", "Sum", "Max", "Min", "Prod", "EuclideanNorm", "ArgMax", "ArgMin"})


def num_elements(tensor: tf.Tensor) -> int:
    """Elements in `tensor` by its static shape; unknown dimensions count `UNKNOWN_DIM_SIZE`.
    Where its op keeps the count of its input (`ALIASING`: a reshape) or reduces it
    (`REDUCTIONS`), no more than the input's: a reshape to a target computed from
    `tf.shape` of a batch of unknown size (a Tile's gradient reshapes to twice its rank)
    has every dimension unknown, and a guess for each would multiply."""
    shape = queries.static_shape(tensor)
    guess = UNKNOWN_DIM_SIZE if shape is None else math.prod(map(dimension_size, shape))
    op = tensor.op
    if (shape is None or None in shape) and op.inputs and op.type in ALIASING | REDUCTIONS:
        source = op.inputs[tensor.value_index if op.type == "IdentityN" else 0]
        return min(guess, num_elements(source))
    return guess


def dimension_size(dim: int | None) -> int:
    """A static dimension's size; `UNKNOWN_DIM_SIZE` where it is unknown."""
    return UNKNOWN_DIM_SIZE if dim is None else dim


def tensor_bytes(tensor: tf.Tensor) -> int:
    """Bytes `tensor` occupies by its static shape (resources and variants count 8 bytes)."""
    dtype = tensor.dtype.base_dtype
    itemsize = 8 if dtype in (tf.resource, tf.variant, tf.string) else dtype.size
    return num_elements(tensor) * itemsize


#: The operands of each product op that TensorFlow's optimizers reassociate with its other
#: one, a factor (NOTE [products reassociated ahead] in `_src/rewriting/ordering.py`).
REASSOCIATED_PRODUCTS = {"Mul": (0, 1), "RealDiv": (0,)}


def fewer_elements(factor: tf.Tensor, product: tf.Tensor) -> bool:
    """Whether `factor` is known to have fewer elements than `product` (a broadcast): one,
    where the product's shape is open."""
    if not factor.shape.is_fully_defined():
        return False
    count = factor.shape.num_elements()
    known = product.shape.is_fully_defined()
    return count == 1 or (known and count < product.shape.num_elements())


#: Matrix products, batched or not.
MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
#: Contractions: each output element sums products over an inner dimension or a window.
CONTRACTIONS = MATMULS | {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "Einsum"}


# NOTE [einsum's transposes]: TensorFlow's Einsum kernel (einsum_op_impl.h, which oneDNN's
# shares) contracts by a batched matrix product. Each operand must first have its dimensions
# ordered by kind (batch, free, contracted, summed), each kind in the order its labels first
# appear in the equation; an operand already in that order, or with free and contracted
# swapped (the product then takes it transposed), is read in place, any other is copied so
# ordered. The product's result is ordered batch, then the first operand's free labels, then
# the second's; where the output asks another order it is copied once more. The copies live
# until the kernel returns, beside its output: Keras's attention scores `aecd,abcd->acbe`
# copy the keys, the queries and the scores, and their gradients copy as much (profiled).
_BATCH, _FREE, _CONTRACTED, _SUMMED = range(4)


def einsum_working_bytes(op: tf.Operation, input_bytes: Sequence[int], output_bytes: int) -> int:
    """Bytes the Einsum `op`'s kernel holds beside its inputs and output: the copies of the
    operands and of the product it reorders (NOTE [einsum's transposes]), given each input's
    bytes and the output's. Counted for two operands with distinct named labels each; 0 for
    ellipses, diagonals and single operands."""
    equation = op.get_attr("equation").decode().replace(" ", "")
    operands, _, output = equation.partition("->")
    inputs = operands.split(",")
    if len(inputs) != 2 or "." in equation:
        return 0
    if any(len(set(labels)) != len(labels) for labels in (*inputs, output)):
        return 0
    first_seen: dict[str, int] = {}
    for label in "".join(inputs) + output:
        first_seen.setdefault(label, len(first_seen))
    sizes: dict[str, int | None] = {}
    for labels, tensor in zip((*inputs, output), (*op.inputs, op.outputs[0]), strict=True):
        sizes.update(zip(labels, queries.static_shape(tensor) or (), strict=False))
    kind = {
        label: (
            (_BATCH if label in output else _CONTRACTED)
            if label in inputs[0] and label in inputs[1]
            else (_FREE if label in output else _SUMMED)
        )
        for label in first_seen
    }
    swapped_kind = {**kind, **{k: _CONTRACTED for k, v in kind.items() if v == _FREE}}
    swapped_kind.update({k: _FREE for k, v in kind.items() if v == _CONTRACTED})

    def data_order(labels: Sequence[str]) -> list[str]:
        """The labels whose dimensions a reordering moves (those of size one move nothing)."""
        return [label for label in labels if sizes.get(label) != 1]

    copied, free = 0, []
    for labels, held in zip(inputs, input_bytes, strict=True):
        order = list(labels)
        if order != sorted(labels, key=lambda label: (swapped_kind[label], first_seen[label])):
            order = sorted(labels, key=lambda label: (kind[label], first_seen[label]))
            copied += held if data_order(order) != data_order(labels) else 0
        free.append([label for label in order if kind[label] == _FREE])
    batch = sorted(
        (label for label in output if kind[label] == _BATCH), key=first_seen.__getitem__
    )
    product = [*batch, *free[0], *free[1]]
    return copied + (output_bytes if data_order(product) != data_order(output) else 0)


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
    of each operand and of its result. bfloat16 runs natively in oneDNN, but on a CPU without
    AMX a MatMul fused with the BiasAdd after it (grappler's remapper) holds its result in
    float32 (with AMX it holds nothing more). Other kernels' scratch space is not counted
    here (float16 convolution gradients on CPU hold scratch whatever their shapes): measured
    costs (`measured.py`) see it."""
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


def computed_from_shapes(tensor: tf.Tensor) -> bool:
    """Whether `tensor`'s value follows from static shapes and constants alone, as the
    target of the reshape inside `tf.tensordot`, computed from `tf.shape` of its input: under
    XLA, where every shape is static, a compile-time constant."""
    pending, seen = [tensor.op], set()
    while pending:
        op = pending.pop()
        if op in seen or op.type in SHAPE_OF or op.type == "Const":
            continue
        if not op.inputs or _tf.is_stateful(op):
            return False
        seen.add(op)
        pending.extend(t.op for t in op.inputs)
    return True
