"""The arguments of `gradients`, checked early: every error names the value at fault and the fix.

`tf.gradients` reports many of these mistakes late, deep inside a gradient function, or not at
all; a rewrite that copies half the graph first would make them harder still to trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from memory_saving_gradients import _tf


@dataclasses.dataclass(frozen=True)
class Arguments:
    """Validated arguments: graph tensors of the graph of ys (or, for xs and stop_gradients,
    of a graph enclosing it when ys live in a function body)."""

    graph: tf.Graph
    ys: list[tf.Tensor]
    xs: list[tf.Tensor]
    grad_ys: list[tf.Tensor | None] | None
    stop_gradients: tuple[tf.Tensor, ...]

    @property
    def unique_xs(self) -> list[tf.Tensor]:
        return list({x.ref(): x for x in self.xs}.values())

    @property
    def xs_outside_graph(self) -> list[tf.Tensor]:
        """xs of an enclosing graph, which only TensorFlow's capture tracking can reach."""
        return [x for x in self.xs if x.graph is not self.graph]


def check_graph_mode() -> None:
    if tf.executing_eagerly():
        raise RuntimeError(
            "memory_saving_gradients.gradients rewrites a graph, and eager execution has none: "
            "call it inside a tf.function (or a tf.compat.v1 Graph), or use tf.GradientTape "
            "for eager gradients."
        )


def parse(ys, xs, grad_ys, stop_gradients) -> Arguments:
    """Check and convert the user's arguments; call inside `graph_of(ys).as_default()`."""
    ys_list = as_list(ys)
    graph = graph_of(ys_list)
    enclosing = _enclosing_graphs(graph)
    ys_tensors = [_tensor(y, "ys", [graph]) for y in ys_list]
    for y in ys_tensors:
        if not (y.dtype.is_floating or y.dtype.is_complex):
            raise TypeError(
                f"ys entry {y.name} has dtype {y.dtype.name}: gradients flow only from "
                "floating-point or complex tensors. Differentiate a float tensor instead, e.g. "
                "tf.cast(y, tf.float32) of the float value it was computed from."
            )
    stops = [] if stop_gradients is None else as_list(stop_gradients)
    return Arguments(
        graph=graph,
        ys=ys_tensors,
        xs=[_tensor(x, "xs", enclosing) for x in as_list(xs)],
        grad_ys=_grad_ys(grad_ys, ys_tensors),
        stop_gradients=tuple(_tensor(t, "stop_gradients", enclosing) for t in stops),
    )


def as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def graph_of(ys: list) -> tf.Graph:
    """The graph ys live in: that of the first graph tensor, else the default graph."""
    for y in ys:
        if isinstance(y, tf.Tensor) and hasattr(y, "graph"):
            return y.graph
    return tf.compat.v1.get_default_graph()


def _enclosing_graphs(graph: tf.Graph) -> list[tf.Graph]:
    """`graph` and, for a function body, the graphs it is nested in."""
    graphs = [graph]
    while getattr(graphs[-1], "outer_graph", None) is not None:
        graphs.append(graphs[-1].outer_graph)
    return graphs


def _tensor(value, what: str, graphs: Sequence[tf.Graph]) -> tf.Tensor:
    """`value` as a graph tensor of one of `graphs` (a variable as its handle for xs).

    Keras 3 variables are no `tf.Variable` but are differentiated through their handle too.
    """
    if _tf.is_resource_variable(value):
        value = value.handle if what == "xs" else tf.convert_to_tensor(value)
    if isinstance(value, tf.IndexedSlices) or not tf.is_tensor(value):
        raise TypeError(
            f"{what} must hold dense tensors or variables; got {value!r}. "
            "Convert other values with tf.convert_to_tensor first."
        )
    value = tf.convert_to_tensor(value)
    if not hasattr(value, "graph") or not any(value.graph is g for g in graphs):
        raise ValueError(
            f"{what} entry {getattr(value, 'name', value)} is not a tensor of the graph of ys "
            f"({graphs[0]}): build ys, xs and checkpoints in the same graph or tf.function."
        )
    return value


def _grad_ys(grad_ys, ys: list[tf.Tensor]) -> list[tf.Tensor | None] | None:
    if grad_ys is None:
        return None
    grad_ys = as_list(grad_ys)
    if len(grad_ys) != len(ys):
        raise ValueError(f"Passed {len(grad_ys)} grad_ys for {len(ys)} ys; give one per y.")
    checked = []
    for i, (grad_y, y) in enumerate(zip(grad_ys, ys, strict=True)):
        if grad_y is None:
            checked.append(None)
            continue
        grad_y = tf.convert_to_tensor(grad_y, dtype_hint=y.dtype)
        if grad_y.dtype != y.dtype:
            raise TypeError(
                f"grad_ys[{i}] has dtype {grad_y.dtype.name} but ys[{i}] ({y.name}) has "
                f"{y.dtype.name}: pass tf.cast(grad_ys[{i}], {y.dtype.name})."
            )
        if not grad_y.shape.is_compatible_with(y.shape):
            raise ValueError(
                f"grad_ys[{i}] has shape {grad_y.shape} but ys[{i}] ({y.name}) has shape "
                f"{y.shape}: give each y a gradient of its own shape."
            )
        checked.append(grad_y)
    return checked
