"""Read-only queries on a TensorFlow graph: walks, topological order, static shapes.

Inside `tf.function` tensors are unhashable (`t in some_list` even builds an `Equal` op), so
every set and dict here is keyed by the operation or by `tensor.ref()`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import networkx as nx
import tensorflow as tf

from memory_saving_gradients._src import _tf


def backward_ops(
    seeds: Iterable[tf.Operation],
    within: Collection[tf.Operation] | None = None,
    stop_at: Callable[[tf.Tensor], bool] | None = None,
) -> set[tf.Operation]:
    """The seeds and every op whose outputs reach them through data inputs.

    The walk stays inside `within` (when given) and does not cross an input tensor for which
    `stop_at(tensor)` is true. Control inputs are not followed: no gradient flows through them.
    """
    seen: set[tf.Operation] = set()
    stack = list(seeds)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        for tensor in op.inputs:
            producer = tensor.op
            if producer in seen or (within is not None and producer not in within):
                continue
            if stop_at is None or not stop_at(tensor):
                stack.append(producer)
    return seen


def forward_ops(
    seeds: Iterable[tf.Tensor], within: Collection[tf.Operation] | None = None
) -> set[tf.Operation]:
    """Every op that reads the seed tensors, directly or through other ops, inside `within`."""
    seen: set[tf.Operation] = set()
    stack = [op for tensor in seeds for op in tensor.consumers()]
    while stack:
        op = stack.pop()
        if op in seen or (within is not None and op not in within):
            continue
        seen.add(op)
        stack.extend(consumer for out in op.outputs for consumer in out.consumers())
    return seen


#: Op types whose output feeds a TF1 while loop's next iteration: the one kind of edge that
#: closes a cycle in a TensorFlow graph.
BACK_EDGE_TYPES = frozenset({"NextIteration", "RefNextIteration"})


def topological_order(
    ops: Collection[tf.Operation], control_inputs: bool = False
) -> list[tf.Operation]:
    """`ops` ordered so that each comes after the ops it reads (and, with `control_inputs`,
    those it waits for), ties broken by creation order.

    Creation order is the order the user wrote the model in, which keeps the tensors alive
    across any point of the order few (the checkpoint planner relies on that). The back edges
    of TF1 while loops are left out, as TensorFlow's own executor leaves them out.
    """
    dependencies = nx.DiGraph()
    dependencies.add_nodes_from(ops)
    dependencies.add_edges_from(
        (tensor.op, op)
        for op in ops
        for tensor in op.inputs
        if tensor.op in dependencies and tensor.op.type not in BACK_EDGE_TYPES
    )
    if control_inputs:
        dependencies.add_edges_from(
            (before, op) for op in ops for before in op.control_inputs if before in dependencies
        )
    return list(nx.lexicographical_topological_sort(dependencies, key=_tf.creation_index))


def static_shape(tensor: tf.Tensor) -> tuple[int | None, ...] | None:
    """`tensor`'s static shape as ints, None for a dimension unknown until run time, or None
    where even its rank is. The same under TF1 behaviour
    (`tf.compat.v1.disable_v2_behavior()`), whose shapes hold `Dimension` objects, which
    neither hash nor compare as ints."""
    shape = tensor.shape
    if shape.rank is None:
        return None
    return tuple(shape.as_list())


def capture_placeholders(graph: tf.Graph) -> list[tf.Tensor]:
    """The placeholders through which a function body (`tf.function`, `Defun`) reads values
    of the graphs enclosing it; none for a graph that is no function body."""
    if not graph.building_function:
        return []
    return [inner for _, inner in graph.captures]


def captured_value(tensor: tf.Tensor) -> tf.Tensor | None:
    """The value of an enclosing graph that `tensor`, a function body's placeholder, stands
    for; None if `tensor` stands for nothing outside."""
    if not tf.is_symbolic_tensor(tensor):
        return None  # an eager value a function captured
    graph = tensor.graph
    if not graph.building_function or tensor.op.type != "Placeholder":
        return None
    return next((outer for outer, inner in graph.captures if inner is tensor), None)
