"""What each forward op costs: the bytes of its outputs, its compute, what backprop keeps.

Bytes come from static shapes and dtypes (`kernels`). Compute is counted in FLOPs for
contractions (matmul, convolution, einsum) and in output elements for everything else. What an
op's gradient reads, and the ops it runs to make its input gradients, come from TensorFlow's
registered gradient function (`gradient_uses`); where that cannot be built (function calls,
control flow, custom gradients) the gradient is taken to read every input and output and to
make new input gradients. A measured profile (`measured`) replaces the static scratch and
compute with what the kernels did.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import (
    gradient_functions,
    gradient_uses,
    kernels,
    measured,
    queries,
)


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What one forward op costs.

    Attributes:
      output_bytes: bytes each output allocates (0 for aliases and resident values).
      saved_inputs, saved_outputs: indices of the inputs and outputs its gradient reads.
      needed: for each input, whether backprop computes its gradient.
      gradient: what the gradient function the library's backprop uses reads and makes,
        step by step; None where unknown (function calls, control flow, custom gradients):
        such a gradient is taken to read every input and output and to make new input
        gradients.
      tensorflow_gradient: what TensorFlow's registered gradient function reads and makes,
        where backprop uses one of its own instead (`gradient_functions`); None elsewhere.
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
    gradient: gradient_uses.GradientUse | None
    tensorflow_gradient: gradient_uses.GradientUse | None
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
    use = gradient_uses.gradient_use(op)
    replaced = gradient_functions.replacing(op) is not None
    free = op.type in kernels.ALIASING or op.type in kernels.RESIDENT
    if use is None:
        saved_inputs, saved_outputs = list(range(len(op.inputs))), list(range(len(op.outputs)))
    else:
        wanted = [r for r, want in zip(use.reads, needed, strict=True) if want]
        saved_inputs = sorted(set().union(*(r[0] for r in wanted)))
        saved_outputs = sorted(set().union(*(r[1] for r in wanted)))
    output_bytes = tuple(0 if free else kernels.tensor_bytes(t) for t in op.outputs)
    return OpCost(
        output_bytes=output_bytes,
        saved_inputs=tuple(saved_inputs),
        saved_outputs=tuple(saved_outputs),
        needed=tuple(needed),
        gradient=use,
        tensorflow_gradient=gradient_uses.gradient_use(op, registered=True) if replaced else None,
        reuses_input=op.type in kernels.REUSES_INPUT_BUFFER,
        aliases=op.type in kernels.ALIASING,
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
        gradient_working=measurement.gradient_scratch_at_once(kernels.inter_op_threads()),
    )


def _working_bytes(op: tf.Operation, output_bytes: Sequence[int]) -> int:
    if op.type == "Einsum" and not _tf.compiled_by_xla(op.graph):
        return kernels.einsum_working_bytes(
            op, [kernels.tensor_bytes(t) for t in op.inputs], output_bytes[0]
        )
    if op.type not in kernels.MATMULS or not kernels.runs_cpu_kernels(op):
        return 0
    return kernels.working_bytes(
        op.type,
        [(t.dtype, kernels.tensor_bytes(t)) for t in op.inputs],
        output_bytes,
        before_bias_add=[c.type for c in op.outputs[0].consumers()] == ["BiasAdd"],
    )


def flops(op: tf.Operation) -> float:
    """Floating-point operations of `op`: multiply-adds count two."""
    if not op.outputs:
        return 0.0
    out = kernels.num_elements(op.outputs[0])
    if op.type in kernels.MATMULS:
        a = op.inputs[0]
        transposed = op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x")
        inner = _dim(a, -2 if transposed else -1)
        return 2.0 * out * inner
    if op.type in ("Conv2D", "Conv3D", "DepthwiseConv2dNative"):
        kernel = queries.static_shape(op.inputs[1]) or (None, None, None)
        window = math.prod(kernels.dimension_size(d) for d in kernel[:-2])
        per_output = (
            window
            if op.type == "DepthwiseConv2dNative"
            else window * kernels.dimension_size(kernel[-2])
        )
        return 2.0 * out * per_output
    if op.type in ("Conv2DBackpropInput", "Conv3DBackpropInputV2"):
        kernel = queries.static_shape(op.inputs[1]) or (None, None)
        return (
            2.0
            * kernels.num_elements(op.inputs[2])
            * math.prod(kernels.dimension_size(d) for d in kernel[:-1])
        )
    if op.type == "Einsum":
        return 2.0 * _einsum_terms(op)
    if op.type in kernels.REDUCTIONS and op.inputs:  # a pass over all of its input
        return float(max(out, kernels.num_elements(op.inputs[0])))
    return float(out)


def _einsum_terms(op: tf.Operation) -> float:
    """Products an Einsum forms: the product of the sizes of all its distinct indices."""
    equation = op.get_attr("equation").decode()
    operands = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, tensor in zip(operands, op.inputs, strict=False):
        shape = queries.static_shape(tensor) or ()
        if "." in letters or len(letters) != len(shape):
            return float(kernels.num_elements(op.outputs[0]))
        sizes.update(
            (letter, kernels.dimension_size(d)) for letter, d in zip(letters, shape, strict=True)
        )
    return float(np.prod(list(sizes.values()), dtype=np.float64))


def _dim(tensor: tf.Tensor, axis: int) -> int:
    shape = queries.static_shape(tensor)
    return kernels.UNKNOWN_DIM_SIZE if shape is None else kernels.dimension_size(shape[axis])
