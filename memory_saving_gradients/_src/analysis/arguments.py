"""The arguments of `gradients`, checked early: every error names the value at fault and the fix.

`tf.gradients` reports many of these mistakes late, deep inside a gradient function, or not at
all; a rewrite that copies half the graph first would make them harder still to trace. Where
`tf.gradients` accepts what the rewrite cannot take apart, the arguments say why, and
TensorFlow's own gradients are computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeAlias

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis.measured import MeasuredCosts

#: What users pass as ys and xs.
TensorLike: TypeAlias = tf.Tensor | tf.Variable
#: A gradient as `tf.gradients` returns it: dense, or the IndexedSlices of a gather.
Gradient: TypeAlias = tf.Tensor | tf.IndexedSlices


@dataclasses.dataclass(frozen=True)
class Arguments:
    """Validated arguments: graph tensors of `graph` or of graphs enclosing it.

    Attributes:
      graph: where the gradients are built: the graph of ys, or the function body being
        built inside it.
      ys, grad_ys: the differentiated tensors and their gradients (None for the default),
        of `graph` or of graphs enclosing it.
      xs: the tensors differentiated against, variables as their handles, of `graph` or of
        graphs enclosing it (`enclosing` follows them there).
      stop_gradients: as for `tf.gradients`.
      unconnected_gradients: as for `tf.gradients`, checked.
      only_tensorflow: why only TensorFlow's own gradients can be computed, if so.
    """

    graph: tf.Graph
    ys: list[tf.Tensor]
    xs: list[tf.Tensor]
    grad_ys: list[Gradient | None] | None
    stop_gradients: tuple[tf.Tensor, ...]
    unconnected_gradients: tf.UnconnectedGradients
    only_tensorflow: str | None

    @property
    def unique_xs(self) -> list[tf.Tensor]:
        return list({x.ref(): x for x in self.xs}.values())

    def without_constant_ys(self) -> Arguments:
        """The arguments less the ys gradients cannot flow from (integers, booleans): as in
        `tf.gradients`, they contribute nothing."""
        keep = [i for i, y in enumerate(self.ys) if _tf.is_differentiable(y)]
        return dataclasses.replace(
            self,
            ys=[self.ys[i] for i in keep],
            grad_ys=None if self.grad_ys is None else [self.grad_ys[i] for i in keep],
        )


def check_graph_mode() -> None:
    if tf.executing_eagerly():
        raise RuntimeError(
            "memory_saving_gradients.gradients rewrites a graph, and eager execution has none: "
            "call it inside a tf.function (or a tf.compat.v1 Graph), or use tf.GradientTape "
            "for eager gradients."
        )


def parse(ys, xs, grad_ys, stop_gradients, unconnected_gradients) -> Arguments:
    """Check the user's arguments and convert them in the graph the gradients go to."""
    try:
        unconnected = tf.UnconnectedGradients(unconnected_gradients)
    except ValueError:
        message = f"Unknown value for unconnected_gradients: '{unconnected_gradients}'"
        raise ValueError(message) from None
    ys_list, xs_list = as_list(ys), as_list(xs)
    stops = tuple([] if stop_gradients is None else as_list(stop_gradients))
    composite = [v for v in [*ys_list, *xs_list] if _is_composite(v)]
    if composite:
        return Arguments(
            graph=tf.compat.v1.get_default_graph(),
            ys=ys_list,
            xs=xs_list,
            grad_ys=None if grad_ys is None else as_list(grad_ys),
            stop_gradients=stops,
            unconnected_gradients=unconnected,
            only_tensorflow=f"{composite[0]!r} is a composite tensor (ragged, sparse)",
        )
    graph = graph_of(ys_list)
    current = tf.compat.v1.get_default_graph()
    if any(g is graph for g in _enclosing_graphs(current)):
        graph = current  # a function body built inside the graph of ys, which it captures
    enclosing = _enclosing_graphs(graph)
    with graph.as_default():
        ys_tensors = [_tensor(y, "ys", enclosing) for y in ys_list]
        xs_tensors = [_tensor(x, "xs", enclosing) for x in xs_list]
        return Arguments(
            graph=graph,
            ys=ys_tensors,
            xs=xs_tensors,
            grad_ys=_grad_ys(grad_ys, ys_tensors),
            stop_gradients=tuple(_tensor(t, "stop_gradients", enclosing) for t in stops),
            unconnected_gradients=unconnected,
            only_tensorflow=_only_tensorflow(graph, ys_tensors, xs_tensors),
        )


def _only_tensorflow(graph: tf.Graph, ys: list[tf.Tensor], xs: list[tf.Tensor]) -> str | None:
    """Why only TensorFlow's own gradients apply to these arguments, if so."""
    if _tf.building_in_v1_control_flow(graph):
        return "called inside a TF1 while loop or cond, whose frames recomputed ops cannot enter"
    if ys and all(y.graph is not graph for y in ys):
        return "ys belong to a graph enclosing the function being built"
    xs_refs = {x.ref() for x in xs}
    if any(y.ref() in xs_refs and not _tf.is_differentiable(y) for y in ys):
        return "an integer or boolean y is also one of xs"
    return None


def _is_composite(value) -> bool:
    """Whether `value` is a composite tensor other than IndexedSlices and variables (ragged,
    sparse)."""
    composite = isinstance(value, tf.__internal__.CompositeTensor)
    return composite and not (
        isinstance(value, tf.IndexedSlices) or _tf.is_resource_variable(value)
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


def _grad_ys(grad_ys, ys: list[tf.Tensor]) -> list[Gradient | None] | None:
    """The grad_ys as tensors, IndexedSlices left as they are (`tf.gradients` keeps them)."""
    if grad_ys is None:
        return None
    grad_ys = as_list(grad_ys)
    if len(grad_ys) != len(ys):
        raise ValueError(f"Passed {len(grad_ys)} grad_ys for {len(ys)} ys; give one per y.")
    checked: list[Gradient | None] = []
    for i, (grad_y, y) in enumerate(zip(grad_ys, ys, strict=True)):
        if grad_y is None:
            checked.append(None)
            continue
        if not isinstance(grad_y, tf.IndexedSlices):
            grad_y = tf.convert_to_tensor(grad_y, dtype_hint=y.dtype)
        if grad_y.dtype != y.dtype:
            raise TypeError(
                f"grad_ys[{i}] has dtype {grad_y.dtype.name} but ys[{i}] ({y.name}) has "
                f"{y.dtype.name}: pass tf.cast(grad_ys[{i}], {y.dtype.name})."
            )
        if isinstance(grad_y, tf.Tensor) and not grad_y.shape.is_compatible_with(y.shape):
            raise ValueError(
                f"grad_ys[{i}] has shape {grad_y.shape} but ys[{i}] ({y.name}) has shape "
                f"{y.shape}: give each y a gradient of its own shape."
            )
        checked.append(grad_y)
    return checked


def check_update_scratch(update_scratch: object) -> None:
    """`update_scratch` is a number of gradients' bytes, zero or more."""
    if (
        isinstance(update_scratch, bool)
        or not isinstance(update_scratch, int | float)
        or not 0 <= update_scratch < float("inf")
    ):
        raise ValueError(
            f"update_scratch={update_scratch!r} is not a number of gradients' bytes, zero or "
            "more: pass the temporaries an optimizer's update of one variable holds beside "
            "its gradient, over the gradient's bytes (2 for Adam; 0, the default, for SGD)."
        )


def check_costs(costs: object) -> None:
    """`costs` is None or what `measure_costs` returns."""
    if costs is not None and not isinstance(costs, MeasuredCosts):
        raise TypeError(
            f"costs must be what measure_costs returns (MeasuredCosts), not "
            f"{type(costs).__name__}: measure_costs(plain_step) profiles the plain step."
        )
