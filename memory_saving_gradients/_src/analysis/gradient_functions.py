"""Gradient functions the library's backprop uses in place of TensorFlow's registered ones,
where those hold more memory than the gradient needs; each computes what TensorFlow's does,
the same arithmetic on the same values (float32 round-off where graph optimizers reorder it).

NOTE [softmax gradient in slices]: TensorFlow's softmax gradient is
`(g - reduce_sum(g * s, -1)) * s`. The product `g * s` is a third tensor of the softmax's
size, alive beside the softmax and its gradient, and on attention that is the peak of every
block's backprop (three matrices of batch x heads x length x length). The sums are taken here
over slices of rows instead, so only the slices' products are alive, an eighth each. Each row
is reduced by the same kernel over the same values. The slices are cut from the tensors
flattened to one dimension, at multiples of 32 rows: TensorFlow's strided slice shares the
buffer of a one-dimensional slice whose ends lie on its alignment (64 bytes) and copies
any other, and a slice of rows of a two-dimensional tensor is shared only where a row's
bytes are a multiple of it (lengths of 16, 32, ... elements). Slicing waits for the
arriving gradient: a slice of the forward softmax reads no gradient, so the executor would
otherwise cut it in the forward pass and hold it until backprop. The subtraction and the
last product then take over the gradient's buffer, as TensorFlow's do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import tensorflow as tf

from memory_saving_gradients._src import _tf

#: Rows of a softmax are reduced in this many slices (NOTE [softmax gradient in slices]).
SOFTMAX_SLICES = 8
#: Slices start at a multiple of this many rows: 64 bytes (TensorFlow's largest alignment)
#: for any row of elements of two bytes or more, so each slice but the last is a view.
_ALIGNED_ROWS = 32
#: Softmaxes with fewer elements keep TensorFlow's gradient: their third tensor is small, and
#: the slices' ops would cost more time than its bytes are worth.
SOFTMAX_SLICED_FROM = 1 << 18

GradientFunction = Callable[..., tf.Tensor]


def replaced(ops: Iterable[tf.Operation]) -> dict[tf.Operation, GradientFunction]:
    """The ops of `ops` that backprop differentiates by a function of the library's, each with
    that function (`replacing`)."""
    return {op: function for op in ops if (function := replacing(op)) is not None}


def replacing(op: tf.Operation) -> GradientFunction | None:
    """The gradient function backprop uses for `op` in place of TensorFlow's registered one,
    or None where it keeps TensorFlow's: ops with a gradient of their own (`tf.custom_gradient`,
    `gradient_override_map`), graphs XLA compiles (which fuses the product away itself), TF1
    control flow, and small softmaxes."""
    if op.type != "Softmax" or _tf.has_own_gradient(op) or _tf.in_v1_control_flow(op):
        return None
    if _tf.compiled_by_xla(op.graph):
        return None
    elements = op.outputs[0].shape.num_elements()
    if elements is not None and elements < SOFTMAX_SLICED_FROM:
        return None
    return softmax_gradient


def softmax_gradient(op: tf.Operation, gradient: tf.Tensor) -> tf.Tensor:
    """TensorFlow's softmax gradient, its row sums taken in slices (NOTE [softmax gradient in
    slices]). Where the softmax's shape is static the slices' bounds are too, so their
    shapes are known to the cost model."""
    softmax = op.outputs[0]
    static = softmax.shape
    if static.is_fully_defined() and static.rank:
        depth, rows = static[-1], static.num_elements() // max(static[-1], 1)
        summed_shape: tf.Tensor | list[int] = [*static[:-1], 1]
    else:
        shape = tf.shape(softmax, out_type=tf.int64)
        depth = shape[-1]
        rows = tf.size(softmax, out_type=tf.int64) // tf.maximum(depth, 1)
        summed_shape = tf.concat([shape[:-1], tf.ones([1], tf.int64)], 0)
    with tf.control_dependencies([gradient]):
        flat_softmax = tf.reshape(softmax, [-1])
    flat_gradient = tf.reshape(gradient, [-1])
    bounds = [
        *(
            (rows * i // SOFTMAX_SLICES) // _ALIGNED_ROWS * _ALIGNED_ROWS
            for i in range(SOFTMAX_SLICES)
        ),
        rows,
    ]
    if isinstance(rows, int):
        bounds = list(dict.fromkeys(bounds))  # no empty slices where there are few rows
    sums = [
        tf.reduce_sum(
            tf.reshape(
                flat_gradient[start * depth : end * depth]
                * flat_softmax[start * depth : end * depth],
                [-1, depth],
            ),
            -1,
        )
        for start, end in itertools.pairwise(bounds)
    ]
    summed = tf.reshape(tf.concat(sums, 0), summed_shape)
    return (gradient - summed) * softmax
