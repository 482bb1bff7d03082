"""Checkpoints named by Keras layer: `layer_outputs("block1_out", "block2_out")`.

Keras users think in layers ("keep the output of every block"), as `keras.RematScope`'s
`list_of_layers` mode promises. `layer_outputs` turns layer names, or a predicate on layers,
into a checkpoint policy that keeps those layers' outputs in the traced step, for
`msg.keras.enable`, `msg.GradientTape` and `msg.gradients` alike.

NOTE [layer outputs in the graph]
A policy sees the traced graph, not the Keras model, so a layer's calls are found by the name
scopes their ops carry. Keras 3's `Layer.__call__` opens `tf.name_scope(layer.name)` twice per
call, first around `build` and then around `call`, and a graph gives each scope a name of its
own: the scope holding a call's ops is always the layer's name plus one `_<n>` suffix. Layer
`dense` runs in `dense_1`, layer `dense_1` in `dense_1_2`, a shared layer in one scope per call
and a nested model's layers inside the nested model's scope, so stripping exactly one suffix
names the layer, even among Keras's own numbered names. A call's outputs are the tensors made
inside its scope that an op of the forward pass outside it reads (or that are differentiated
themselves): under `keras.RematScope(mode="activations")`, the `IdentityN` through which the
activation's custom gradient passes it on.

The graph is read, rather than the calls recorded as they run, because Keras 3 has no hook on
a layer's call: recording would wrap the `call` of each layer of the user's model (which
RematScope wraps again) and tie the policy to one trace. The model serves only to check names
early and to evaluate predicates: `msg.keras.enable` passes its own, `model=` passes one
elsewhere. Without a model, a name that no scope of the graph carries is an error when the
plan is made.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TypeAlias

import keras
import tensorflow as tf

from memory_saving_gradients._src.analysis.view import ForwardView, why_not_recomputable
from memory_saving_gradients._src.planning.plans import Plan
from memory_saving_gradients._src.planning.policies import NoCheckpointsError

logger = logging.getLogger(__name__)

#: Picks layers by the layer object: `lambda layer: isinstance(layer, keras.layers.Add)`.
LayerPredicate: TypeAlias = Callable[[keras.layers.Layer], bool]

#: The suffix a graph adds to make a name scope unique (NOTE [layer outputs in the graph]).
_UNIQUE_SUFFIX = re.compile(r"_\d+$")
#: How many known layer names an error about an unknown one lists.
_LISTED = 12


def layer_outputs(*layers: str | LayerPredicate, model: keras.Model | None = None) -> LayerOutputs:
    """A checkpoint policy keeping the outputs of Keras layers, picked by name or predicate.

        msg.keras.enable(model, checkpoints=msg.keras.layer_outputs("block1_out", "block2_out"))
        msg.keras.layer_outputs(lambda layer: layer.name.endswith("_out"), model=model)

    Every call of a layer is kept (a shared layer's, a nested model's); layers inside nested
    models and custom layers are found by their own names. Pass it as `checkpoints=` to
    `msg.keras.enable` (which gives it the model), `msg.GradientTape` or `msg.gradients`. With
    `model` (or through `enable`) names are checked against the model's layers at once and a
    predicate is evaluated on them; a predicate needs a model.

    Raises:
      TypeError: `layers` is not names or one callable, or `model` is no Keras model.
      ValueError: no layer is given; with a model, a name is no layer of it, or the
        predicate picks none (the message names it and lists the model's layers).
    """
    if not layers:
        raise ValueError(
            "layer_outputs needs layer names or one predicate on layers, e.g. "
            "layer_outputs('block1_out') or "
            "layer_outputs(lambda layer: isinstance(layer, keras.layers.Add))."
        )
    if all(isinstance(layer, str) for layer in layers):
        policy = LayerOutputs(names=tuple(dict.fromkeys(layers)))  # type: ignore[arg-type]
    elif len(layers) == 1 and callable(layers[0]):
        policy = LayerOutputs(predicate=layers[0])
    else:
        raise TypeError(
            "layer_outputs takes layer names (strings) or one predicate on layers (a "
            f"callable), not a mix or anything else: got {layers!r}."
        )
    return policy if model is None else policy.bound_to(model)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class LayerOutputs:
    """The checkpoint policy `layer_outputs` makes: called with a `ForwardView`, the plan
    keeping the outputs of every call of the layers named `names` (NOTE [layer outputs in
    the graph]).

    Attributes:
      names: the layers whose outputs are kept; for a predicate, those it picked in `model`.
      predicate: what picks the layers, or None where they are named.
      model: the model the names were checked against, or None.
    """

    names: tuple[str, ...] = ()
    predicate: LayerPredicate | None = None
    model: keras.Model | None = None

    def bound_to(self, model: keras.Model) -> LayerOutputs:
        """This policy for the layers of `model`: names checked, a predicate evaluated.

        Raises:
          TypeError: `model` is no Keras model.
          ValueError: a name is no layer of `model`, or the predicate picks none.
        """
        if not isinstance(model, keras.Model):
            raise TypeError(f"layer_outputs takes a keras.Model as model=, got {model!r}.")
        layers = layers_of(model)
        known = [layer.name for layer in layers]
        if self.predicate is None:
            unknown = [name for name in self.names if name not in known]
            if unknown:
                raise _unknown_layers(unknown, known, f"model {model.name!r}")
            return dataclasses.replace(self, model=model)
        picked = tuple(dict.fromkeys(layer.name for layer in layers if self.predicate(layer)))
        if not picked:
            raise ValueError(
                f"{self!r} picks no layer of model {model.name!r}, whose layers are "
                f"{_listed(known)}."
            )
        return dataclasses.replace(self, names=picked, model=model)

    def __call__(self, view: ForwardView) -> Plan:
        """The plan keeping the outputs of the layers' calls in `view`'s graph.

        Raises:
          ValueError: a predicate has no model to pick from; without a model, a name that
            no layer call in the graph carries.
          NoCheckpointsError: no output of these layers can be recomputed from.
        """
        if self.predicate is not None and self.model is None:
            raise ValueError(
                f"{self!r} needs the model whose layers the predicate picks: pass model= to "
                "layer_outputs, or the policy to msg.keras.enable(model, checkpoints=...), "
                "which passes its model."
            )
        graph = view.ys[0].graph
        wanted = set(self.names)
        called = {name for op in graph.get_operations() for name, _ in _calls(op, wanted)}
        missing = [name for name in self.names if name not in called]
        if missing and self.model is None:  # with a model, bound_to checked the names
            raise _unknown_layers(missing, _scope_layer_names(graph), "this graph")
        problems = [f"layer {name!r} is not called in this graph" for name in missing]
        kept: dict = {}
        xs_ops = frozenset(x.op for x in view.xs)
        for name, outputs in _outputs_by_layer(view, self.names).items():
            if name in called and not outputs:
                problems.append(
                    f"layer {name!r} makes no output between xs and ys (its calls make no "
                    "op there, or return their input)"
                )
            for tensor in outputs:
                if tensor.op in view.recomputable:
                    kept[tensor.ref()] = tensor
                else:
                    problems.append(
                        f"layer {name!r}'s output {tensor.name} is no checkpoint: its op is "
                        f"never recomputed ({why_not_recomputable(tensor.op, xs_ops)}), so "
                        "backprop keeps it anyway"
                    )
        if not kept:
            raise NoCheckpointsError(
                f"checkpoints={self!r} gave no tensor that can be recomputed from: "
                + "; ".join(problems)
                + ". Name layers whose outputs lie between xs and ys, or use "
                "checkpoints='memory'."
            )
        for problem in problems:
            logger.warning("%r: %s.", self, problem)
        return Plan(view, [list(kept.values())], repr(self))

    def __repr__(self) -> str:
        if self.predicate is None:
            return f"layer_outputs({', '.join(map(repr, self.names))})"
        return f"layer_outputs({getattr(self.predicate, '__name__', repr(self.predicate))})"


def _calls(op: tf.Operation, wanted: set[str]) -> Iterator[tuple[str, str]]:
    """(layer name, call scope) of each call of a `wanted` layer whose scope holds `op`."""
    parts = op.name.split("/")[:-1]
    for depth, part in enumerate(parts):
        layer = _UNIQUE_SUFFIX.sub("", part)
        if layer != part and layer in wanted:
            yield layer, "/".join(parts[: depth + 1])


def _outputs_by_layer(view: ForwardView, names: tuple[str, ...]) -> dict[str, list[tf.Tensor]]:
    """The outputs of every call in `view` of each layer named in `names`."""
    ops_by_call: dict[tuple[str, str], list[tf.Operation]] = {}
    for op in view.ops:
        for call in _calls(op, set(names)):
            ops_by_call.setdefault(call, []).append(op)
    outputs: dict[str, list[tf.Tensor]] = {name: [] for name in names}
    for (name, _), ops in ops_by_call.items():
        outputs[name].extend(_outputs(view, ops))
    return outputs


def _outputs(view: ForwardView, ops: list[tf.Operation]) -> list[tf.Tensor]:
    """The outputs of a call's `ops` that an op of `view` outside them reads, or that are ys."""
    inside = set(ops)
    ys = {y.ref() for y in view.ys}
    return [
        out
        for op in ops
        for out in op.outputs
        if out.ref() in ys or any(reader not in inside for reader in view.consumers(out))
    ]


def layers_of(model: keras.Model) -> list[keras.layers.Layer]:
    """The model and every layer inside it, those of nested models and custom layers too.
    Keras 3 has no public walk of them all (`Model.layers` is one level, and only models have
    it); `_flatten_layers` is the walk Keras itself uses for weights and summaries."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def _scope_layer_names(graph: tf.Graph) -> list[str]:
    """Names of what looks like layer calls in `graph` (scopes with a unique suffix)."""
    names: dict[str, None] = {}
    for op in graph.get_operations():
        for part in op.name.split("/")[:-1]:
            layer = _UNIQUE_SUFFIX.sub("", part)
            if layer != part:
                names[layer] = None
    return list(names)


def _unknown_layers(unknown: list[str], known: list[str], where: str) -> ValueError:
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        named.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    advice = "" if where.startswith("model") else " Pass model= to check names against it."
    return ValueError(
        f"layer_outputs: no layer named {', '.join(named)} in {where}, whose layers include "
        f"{_listed(known)}.{advice}"
    )


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(map(repr, names[:_LISTED])) + more
