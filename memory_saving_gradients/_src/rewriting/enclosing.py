"""Gradients of xs that a function body reads from the graphs enclosing it.

A function body (a `tf.function`, a `Defun`) reads what an enclosing graph computed through
placeholders that stand for those values, its captures: the variables of a TF1 program,
created in the default graph and read inside a `tf.function`; the values of an outer function
read by an inner one. `tf.gradients` called in the body follows them out into the enclosing
graphs. Here the body's backward pass is checkpointed with those placeholders among its xs.
A placeholder standing for an x passes its gradient on to that x. From one standing for a
value computed from xs in an enclosing graph, and from ys of an enclosing graph, TensorFlow's
own gradients carry the gradients on: those ops ran before the body did, and the body holds
none of their activations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import queries
from memory_saving_gradients._src.analysis.arguments import Arguments, Gradient
from memory_saving_gradients._src.rewriting.backprop import (
    GradientOptions,
    colocated,
    plain_gradients,
)


@dataclasses.dataclass(frozen=True)
class Outside:
    """What of a gradient call lies in the graphs enclosing its function body.

    Attributes:
      ys, grad_ys: the ys of enclosing graphs, and their gradients (None for ones).
      xs: the xs of enclosing graphs.
      placeholders: the body's placeholders standing for xs or for values computed from them.
      values: what each of `placeholders` stands for, followed out through every enclosing
        function body to the graph that computed it.
    """

    ys: tuple[tf.Tensor, ...] = ()
    grad_ys: tuple[Gradient | None, ...] = ()
    xs: tuple[tf.Tensor, ...] = ()
    placeholders: tuple[tf.Tensor, ...] = ()
    values: tuple[tf.Tensor, ...] = ()

    def gradients(
        self, inside: Mapping[object, Gradient | None], options: GradientOptions
    ) -> dict[object, Gradient | None]:
        """The gradients of `xs` (by ref), given those the body's backward pass found for
        its `placeholders` (by ref)."""
        xs = {x.ref() for x in self.xs}
        parts: dict[object, list[Gradient]] = {}
        carried, carried_gradients = list(self.ys), list(self.grad_ys)
        for placeholder, value in zip(self.placeholders, self.values, strict=True):
            gradient = inside[placeholder.ref()]
            if gradient is None:
                continue
            if value.ref() in xs:
                parts.setdefault(value.ref(), []).append(gradient)
            else:
                carried.append(value)
                carried_gradients.append(gradient)
        if carried:
            found = plain_gradients(carried, self.xs, carried_gradients, options)
            for x, gradient in zip(self.xs, found, strict=True):
                if gradient is not None:
                    parts.setdefault(x.ref(), []).append(gradient)
        summed = {}
        for x in self.xs:
            if x.ref() in parts:
                with colocated(x.op, options.colocate_gradients_with_ops):
                    summed[x.ref()] = _tf.sum_gradients(parts[x.ref()])
            else:
                summed[x.ref()] = None
        return summed


def split(args: Arguments) -> tuple[Arguments, Outside]:
    """`args` as the function body `args.graph` sees them (its own ys, and among its xs the
    placeholders standing for what lies outside), and what lies outside."""
    body_graph = args.graph
    outer_xs = [x for x in args.unique_xs if x.graph is not body_graph]
    outer_ys = [i for i, y in enumerate(args.ys) if y.graph is not body_graph]
    if not outer_xs and not outer_ys:
        return args, Outside()
    placeholders, values = _standing_for(body_graph, outer_xs)
    inner_ys = [i for i in range(len(args.ys)) if i not in outer_ys]
    grad_ys = args.grad_ys
    body = dataclasses.replace(
        args,
        ys=[args.ys[i] for i in inner_ys],
        grad_ys=None if grad_ys is None else [grad_ys[i] for i in inner_ys],
        xs=[x for x in args.unique_xs if x.graph is body_graph] + placeholders,
    )
    carried = [i for i in outer_ys if _tf.is_differentiable(args.ys[i])]
    outside = Outside(
        ys=tuple(args.ys[i] for i in carried),
        grad_ys=tuple(None if grad_ys is None else grad_ys[i] for i in carried),
        xs=tuple(outer_xs),
        placeholders=tuple(placeholders),
        values=tuple(values),
    )
    return body, outside


def _standing_for(
    body: tf.Graph, xs: Sequence[tf.Tensor]
) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """The placeholders of `body` whose values are `xs` or are computed from them, and those
    values (captures followed out to the graph that computed them)."""
    xs_refs = {x.ref() for x in xs}
    captured = [(p, _origin(p, xs_refs)) for p in queries.capture_placeholders(body)]
    computed = _computed_from(
        xs_refs, [value for _, value in captured if tf.is_symbolic_tensor(value)]
    )
    placeholders, values = [], []
    for placeholder, value in captured:
        if value.ref() in xs_refs or (tf.is_symbolic_tensor(value) and value.op in computed):
            placeholders.append(placeholder)
            values.append(value)
    return placeholders, values


def _origin(tensor: tf.Tensor, xs_refs: set) -> tf.Tensor:
    """The value `tensor` stands for, captures followed out to the graph that computed it, or
    to one of xs (by ref): as in `tf.gradients`, a placeholder among xs stands for itself."""
    while tensor.ref() not in xs_refs and (value := queries.captured_value(tensor)) is not None:
        tensor = value
    return tensor


def _computed_from(xs_refs: set, values: Sequence[tf.Tensor]) -> set[tf.Operation]:
    """The ops behind `values` that read one of xs (by ref), directly or through others,
    across captures: a walk back from `values`, then one forward from the readers of xs
    over the edges it found (TF1 while loops close cycles, which both walks take)."""
    readers: dict[tf.Operation, list[tf.Operation]] = {}
    reading_xs, seen = [], set()
    stack = [value.op for value in values]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        for tensor in (_origin(t, xs_refs) for t in op.inputs):
            if tensor.ref() in xs_refs:
                reading_xs.append(op)
            elif tf.is_symbolic_tensor(tensor):  # an eager value depends on nothing here
                readers.setdefault(tensor.op, []).append(op)
                stack.append(tensor.op)
    computed: set[tf.Operation] = set()
    stack = reading_xs
    while stack:
        op = stack.pop()
        if op not in computed:
            computed.add(op)
            stack.extend(readers.get(op, ()))
    return computed
