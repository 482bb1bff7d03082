"""`gradients`: `tf.gradients` that keeps only checkpoints of the forward pass.

Backprop normally keeps every forward activation until its gradient is done, so memory grows
with depth. Keeping only checkpoints and recomputing the rest during the backward pass cuts
that to about the square root, for about one extra forward pass (Chen et al. 2016).

Caveats, as they stand:
- Stateful ops (random ops, variable reads, iterators) are never recomputed: their forward
  outputs are kept, so dropout masks and variable values are the ones the forward pass saw.
- A tensor fed through `feed_dict` that is not a placeholder is not seen by recomputed copies.
- Graph mode only: inside `tf.function` or a `tf.compat.v1` graph. Eagerly there is no graph
  to rewrite.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tensorflow as tf

from memory_saving_gradients import _tf
from memory_saving_gradients.rewrite import (
    GradientOptions,
    checkpointed_gradients,
    plain_gradients,
)
from memory_saving_gradients.strategies import CheckpointsArg, select_checkpoints
from memory_saving_gradients.view import ForwardView

logger = logging.getLogger("memory_saving_gradients")

TensorLike = tf.Tensor | tf.Variable
Gradient = tf.Tensor | tf.IndexedSlices


@tf.autograph.experimental.do_not_convert
def gradients(
    ys: TensorLike | Sequence[TensorLike],
    xs: TensorLike | Sequence[TensorLike],
    grad_ys: tf.Tensor | Sequence[tf.Tensor | None] | None = None,
    checkpoints: CheckpointsArg = "collection",
    *,
    name: str = "gradients",
    colocate_gradients_with_ops: bool = True,
    gate_gradients: bool = False,
    aggregation_method=None,
    stop_gradients: tf.Tensor | Sequence[tf.Tensor] | None = None,
    unconnected_gradients: tf.UnconnectedGradients | str = tf.UnconnectedGradients.NONE,
) -> list[Gradient | None]:
    """Symbolic derivatives of sum(ys) with respect to each of xs, like `tf.gradients`.

    Only `checkpoints` are kept from the forward pass; every other activation the backward pass
    needs is recomputed from the nearest checkpoints, segment by segment, when backprop
    reaches it.

    Args:
      ys, xs, grad_ys, name, colocate_gradients_with_ops, gate_gradients, aggregation_method,
        stop_gradients, unconnected_gradients: as in `tf.compat.v1.gradients`.
      checkpoints: the tensors to keep, or a strategy: 'collection' (the graph collection
        'checkpoints', see `add_checkpoint`), 'speed' (outputs of matmuls and convolutions) or
        'memory' (cuts chosen to minimise the estimated peak memory, about sqrt(N) tensors on
        an N-layer chain; when none pays off, plain gradients are computed and logged).

    Returns:
      One gradient per x: a Tensor, an IndexedSlices where `tf.gradients` gives one, or None
      (zeros with unconnected_gradients='zero') for an x that ys do not depend on.

    Raises:
      RuntimeError: called eagerly, outside any graph.
      TypeError, ValueError: ys, xs, grad_ys or checkpoints are not usable; the message names
        the offending value.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "memory_saving_gradients.gradients rewrites a graph, and eager execution has none: "
            "call it inside a tf.function (or a tf.compat.v1 Graph), or use tf.GradientTape "
            "for eager gradients."
        )
    ys_list = _as_list(ys)
    graph = _graph_of(ys_list)
    with graph.as_default():
        ys_list = [_as_graph_tensor(y, graph, "ys") for y in ys_list]
        xs_list = [_as_graph_tensor(x, graph, "xs") for x in _as_list(xs)]
        grad_ys_list = _check_grad_ys(grad_ys, ys_list)
        options = GradientOptions(
            name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            stop_gradients=tuple(
                _as_graph_tensor(t, graph, "stop_gradients")
                for t in ([] if stop_gradients is None else _as_list(stop_gradients))
            ),
        )
        unconnected = tf.UnconnectedGradients(unconnected_gradients)
        unique_xs = list({x.ref(): x for x in xs_list}.values())
        view = ForwardView.build(ys_list, unique_xs)
        chosen = select_checkpoints(view, checkpoints)
        if chosen:
            logger.info("Checkpointing %d tensors.", len(chosen))
            logger.debug("Checkpoints: %s", [t.name for t in chosen])
            grads = checkpointed_gradients(view, chosen, grad_ys_list, options)
        else:
            logger.info("No checkpoints chosen: computing plain gradients.")
            grads = plain_gradients(view, grad_ys_list, options)
        by_x = {
            x.ref(): _fill_unconnected(x, g, unconnected)
            for x, g in zip(unique_xs, grads, strict=True)
        }
        return [by_x[x.ref()] for x in xs_list]


def _with_strategy(strategy: str):
    def shorthand(
        ys: TensorLike | Sequence[TensorLike],
        xs: TensorLike | Sequence[TensorLike],
        grad_ys: tf.Tensor | Sequence[tf.Tensor | None] | None = None,
        **options,
    ) -> list[Gradient | None]:
        return gradients(ys, xs, grad_ys, strategy, **options)

    shorthand.__name__ = shorthand.__qualname__ = f"gradients_{strategy}"
    shorthand.__doc__ = f"`gradients` with checkpoints={strategy!r}; same keyword arguments."
    return tf.autograph.experimental.do_not_convert(shorthand)


gradients_speed = _with_strategy("speed")
gradients_memory = _with_strategy("memory")
gradients_collection = _with_strategy("collection")


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _graph_of(ys: list) -> tf.Graph:
    """The graph ys live in: that of the first graph tensor, else the default graph."""
    for y in ys:
        if isinstance(y, tf.Tensor) and hasattr(y, "graph"):
            return y.graph
    return tf.compat.v1.get_default_graph()


def _as_graph_tensor(value, graph: tf.Graph, what: str) -> tf.Tensor:
    """`value` as a tensor of `graph` (a variable as its handle for xs), or a clear error."""
    if isinstance(value, tf.Variable):
        value = value.handle if what == "xs" else value.value()
    if isinstance(value, tf.IndexedSlices) or not tf.is_tensor(value):
        raise TypeError(
            f"{what} must hold dense tensors or variables; got {value!r}. "
            "Convert other values with tf.convert_to_tensor first."
        )
    value = tf.convert_to_tensor(value)
    if not hasattr(value, "graph") or value.graph is not graph:
        raise ValueError(
            f"{what} entry {getattr(value, 'name', value)} is not a tensor of the graph of ys "
            f"({graph}): build ys, xs and checkpoints in the same graph or tf.function."
        )
    return value


def _check_grad_ys(grad_ys, ys: list[tf.Tensor]) -> list | None:
    if grad_ys is None:
        return None
    grad_ys = _as_list(grad_ys)
    if len(grad_ys) != len(ys):
        raise ValueError(f"Passed {len(grad_ys)} grad_ys for {len(ys)} ys; give one per y.")
    return grad_ys


def _fill_unconnected(x: tf.Tensor, gradient, unconnected: tf.UnconnectedGradients):
    if gradient is None and unconnected == tf.UnconnectedGradients.ZERO:
        return _tf.zero_gradient(x)
    return gradient
