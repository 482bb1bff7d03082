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

NOTE [a product's gradient frees before it makes]: a product's two gradient kernels each read
the arriving gradient and the other operand, and each makes a tensor of its own operand's
size. Where one operand is much the larger (attention's probabilities against the values),
the kernel making the smaller one's gradient is the last reader of the larger: run first, it
lets the larger go before the other kernel makes its gradient of that size. The executor,
left free, runs both at once, and for a moment holds both large tensors: the probabilities,
and their gradient, beside the softmax that gradient is about to need (a masked softmax's
output and its masked copy, or the dropped-out probabilities, are two such matrices). So
the larger operand's gradient waits for the smaller's; where weights are the smaller
operand, that is the order weight gradients are given anyway (NOTE [weight gradients first]
in rewriting/ordering.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import queries

#: Rows of a softmax are reduced in this many slices (NOTE [softmax gradient in slices]).
SOFTMAX_SLICES = 8
#: Slices start at a multiple of this many rows: 64 bytes (TensorFlow's largest alignment)
#: for any row of elements of two bytes or more, so each slice but the last is a view.
_ALIGNED_ROWS = 32
#: Softmaxes with fewer elements keep TensorFlow's gradient: their third tensor is small, and
#: the slices' ops would cost more time than its bytes are worth.
SOFTMAX_SLICED_FROM = 1 << 18

#: Products with batch dimensions whose gradient kernels are ordered (NOTE [a product's
#: gradient frees before it makes]): where the larger operand has at least
#: `PRODUCT_ORDERED_FROM` elements, and `PRODUCT_ORDERED_RATIO` times the other's. Dimensions
#: left open count as one, and the operands must leave as many open (a batch of any size).
BATCHED_PRODUCTS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
PRODUCT_ORDERED_FROM = 1 << 18
PRODUCT_ORDERED_RATIO = 4
#: Ops a gradient function makes that run no kernel of their own: constants, and the
#: placeholders capturing forward tensors where it is built in a function body aside.
_NOT_RUN = frozenset({"Const", "Placeholder"})

GradientFunction = Callable[..., tf.Tensor]


def replaced(ops: Iterable[tf.Operation]) -> dict[tf.Operation, GradientFunction]:
    """The ops of `ops` that backprop differentiates by a function of the library's, each with
    that function (`replacing`)."""
    return {op: function for op in ops if (function := replacing(op)) is not None}


def replacing(op: tf.Operation) -> GradientFunction | None:
    """The gradient function backprop uses for `op` in place of TensorFlow's registered one,
    or None where it keeps TensorFlow's: ops with a gradient of their own (`tf.custom_gradient`,
    `gradient_override_map`), graphs XLA compiles (which schedules and fuses itself), TF1
    control flow, small softmaxes, and products without batch dimensions or of operands of
    like sizes."""
    if op.type != "Softmax" and op.type not in BATCHED_PRODUCTS:
        return None
    if _tf.has_own_gradient(op) or _tf.in_v1_control_flow(op) or _tf.compiled_by_xla(op.graph):
        return None
    if op.type in BATCHED_PRODUCTS:
        return product_gradient if larger_operand(op) is not None else None
    elements = op.outputs[0].shape.num_elements()
    if elements is not None and elements < SOFTMAX_SLICED_FROM:
        return None
    return softmax_gradient


def larger_operand(op: tf.Operation) -> int | None:
    """The index of the batched product `op`'s operand whose gradient waits for the other's
    (NOTE [a product's gradient frees before it makes]); None where neither does."""
    if len(op.inputs) != 2 or (op.type == "Einsum" and not _einsum_has_batch(op)):
        return None
    shapes = [t.shape for t in op.inputs]
    if any(shape.rank is None for shape in shapes):
        return None
    open_dims = [sum(d is None for d in shape.as_list()) for shape in shapes]
    if open_dims[0] != open_dims[1]:
        return None
    sizes = [math.prod(d for d in shape.as_list() if d is not None) for shape in shapes]
    larger = 0 if sizes[0] >= sizes[1] else 1
    if sizes[larger] < max(PRODUCT_ORDERED_FROM, PRODUCT_ORDERED_RATIO * sizes[1 - larger]):
        return None
    return larger


def _einsum_has_batch(op: tf.Operation) -> bool:
    """Whether the Einsum `op` has a batch label: in both operands and in its output."""
    operands, _, output = op.get_attr("equation").decode().replace(" ", "").partition("->")
    first, _, second = operands.partition(",")
    return bool(set(first) & set(second) & set(output) - {"."})


def product_gradient(op: tf.Operation, gradient: tf.Tensor) -> list[tf.Tensor | None]:
    """TensorFlow's gradient of the product `op`, the larger operand's gradient made after the
    smaller's (NOTE [a product's gradient frees before it makes]): the ops computing only the
    larger's wait for the op giving the smaller's."""
    registered, larger = _tf.registered_gradient(op), larger_operand(op)
    assert registered is not None and larger is not None, op  # as `replacing` chose it
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    gradients = list(registered(op, gradient))
    later, earlier = gradients[larger], gradients[1 - larger]
    if later is None or earlier is None:
        return gradients
    made = set(graph.get_operations()[first:])
    after = {
        computing
        for computing in queries.backward_ops([later.op], made)
        - queries.backward_ops([earlier.op], made)
        if computing in made and computing.type not in _NOT_RUN
    }
    for waiting in after:
        if not any(t.op in after for t in waiting.inputs):
            _tf.add_control_inputs(waiting, [earlier.op])
    return gradients


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
