"""`GradientTape`: `tf.GradientTape` whose gradients are checkpointed inside `tf.function`.

Most TensorFlow 2 training steps take gradients with a tape, which never calls `tf.gradients`,
so patching cannot reach them. This tape records like `tf.GradientTape` (it is one), and its
`gradient` hands the graph the tape saw to `memory_saving_gradients.gradients`.

What the tape recorded is read back from the graph: an op counts as recorded when it was
created while the tape was recording (inside `with`, outside `stop_recording`) and reads a
watched tensor, a watched variable or the output of another recorded op, the rule
`tf.GradientTape` follows. Gradients flow through recorded ops only; a source the tape never
tracked gets None (zeros with `unconnected_gradients='zero'`), as with `tf.GradientTape`.

Eagerly there is no graph to rewrite: the tape computes plain gradients and logs once why
nothing is saved. Composite targets or sources (ragged, sparse) take the plain path too, with
a warning. Functions compiled by XLA (`jit_compile=True`) are checkpointed like any other:
the recomputation reads its inputs through a data dependency XLA keeps (NOTE [gates under
XLA] in `_tf`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import queries
from memory_saving_gradients._src.analysis.arguments import graph_of
from memory_saving_gradients._src.analysis.measured import MeasuredCosts
from memory_saving_gradients._src.api import gradients, unconnected_filled
from memory_saving_gradients._src.planning.policies import CheckpointsArg, check_checkpoints

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Span:
    """Ops `graph.get_operations()[start:end]` were created while the tape recorded."""

    graph: tf.Graph
    start: int
    end: int | None = None


class GradientTape(tf.GradientTape):
    """`tf.GradientTape` with checkpointed gradients: one line to swap in.

        with memory_saving_gradients.GradientTape(checkpoints="memory") as tape:
            loss = loss_fn(model(x), y)
        grads = tape.gradient(loss, model.trainable_variables)

    Inside `tf.function` (compiled by XLA or not) only the checkpoints of the forward pass are
    kept; the rest is recomputed segment by segment during the backward pass. `checkpoints` is
    any value `memory_saving_gradients.gradients` takes ('memory', 'balanced', 'speed',
    'collection', a `MemoryBudget`, a list), 'memory' by default (`gradients` defaults to
    the original library's 'collection', for code written for it); `gradients_held` is its
    argument of that name (pass True where the step keeps every gradient until the last is
    made, e.g. to check them all for overflow); `update_scratch` and `costs` too (the
    temporaries an optimizer's update holds beside each gradient, Adam's two; a plain step
    measured by `measure_costs`).
    `jacobian` and `batch_jacobian` are those of `tf.GradientTape`, not checkpointed.
    """

    def __init__(
        self,
        persistent: bool = False,
        watch_accessed_variables: bool = True,
        checkpoints: CheckpointsArg = "memory",
        gradients_held: bool = False,
        costs: MeasuredCosts | None = None,
        update_scratch: float = 0.0,
    ) -> None:
        check_checkpoints(checkpoints)
        super().__init__(persistent=persistent, watch_accessed_variables=watch_accessed_variables)
        self.checkpoints = checkpoints
        self.gradients_held = gradients_held
        self.update_scratch = update_scratch
        self.costs = costs
        self._persistent_tape = persistent
        self._spans: list[_Span] = []
        self._watched_tensors: list[tf.Tensor] = []
        self._used = False
        self._plain_only = False

    def __enter__(self) -> GradientTape:
        super().__enter__()
        self._open_span()
        return self

    def __exit__(self, typ, value, traceback) -> None:
        self._close_span()
        super().__exit__(typ, value, traceback)

    def watch(self, tensor) -> None:
        """Watch a tensor, a variable or a nested structure of them, as `tf.GradientTape`."""
        super().watch(tensor)
        self._watched_tensors.extend(
            t for t in tf.nest.flatten(tensor) if not _tf.is_resource_variable(t)
        )

    @contextlib.contextmanager
    def stop_recording(self) -> Iterator[None]:
        """Pause recording, as `tf.GradientTape.stop_recording`: gradients do not flow through
        the ops made meanwhile."""
        was_recording = self._close_span()
        try:
            with super().stop_recording():
                yield
        finally:
            if was_recording:
                self._open_span()

    def reset(self) -> None:
        """Forget everything recorded, as `tf.GradientTape.reset`."""
        recording = self._close_span()
        super().reset()
        self._spans.clear()
        self._watched_tensors.clear()
        if recording:
            self._open_span()

    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients: tf.UnconnectedGradients | str = tf.UnconnectedGradients.NONE,
    ):
        """Gradients of `target` with respect to `sources`, shaped like `sources`.

        Same contract as `tf.GradientTape.gradient`; inside `tf.function` the forward pass is
        recomputed from checkpoints instead of kept whole.

        Raises:
          RuntimeError: a non-persistent tape is asked for gradients a second time.
          TypeError: `target` is None.
        """
        if self._used:
            raise RuntimeError(
                "A non-persistent GradientTape can only be used to compute one set of "
                "gradients (or jacobians); create it with persistent=True to call gradient "
                "more than once."
            )
        if target is None:
            raise TypeError(
                "GradientTape.gradient got target=None; pass the tensor(s) to differentiate."
            )
        unconnected = tf.UnconnectedGradients(unconnected_gradients)
        if self._plain_only or self._only_plain_gradients(target, sources):
            return super().gradient(target, sources, output_gradients, unconnected)
        if not self._persistent_tape and self._close_span():
            super().__exit__(None, None, None)  # stop recording, as tf.GradientTape does
        flat_grads = self._checkpointed_gradients(
            tf.nest.flatten(target), tf.nest.flatten(sources), output_gradients, unconnected
        )
        self._used = not self._persistent_tape
        return tf.nest.pack_sequence_as(sources, flat_grads)

    def jacobian(self, *args: Any, **kwargs: Any) -> Any:
        """`tf.GradientTape.jacobian`, with TensorFlow's own gradients: inside a loop it
        vectorizes, it differentiates slices of the target recorded outside this tape's
        spans (checkpointed, a weight's jacobian came back None)."""
        with self._plain_gradients():
            return super().jacobian(*args, **kwargs)

    def batch_jacobian(self, *args: Any, **kwargs: Any) -> Any:
        """`tf.GradientTape.batch_jacobian`, with TensorFlow's own gradients (`jacobian`)."""
        with self._plain_gradients():
            return super().batch_jacobian(*args, **kwargs)

    @contextlib.contextmanager
    def _plain_gradients(self) -> Iterator[None]:
        self._plain_only = True
        try:
            yield
        finally:
            self._plain_only = False

    def _only_plain_gradients(self, target, sources) -> bool:
        """Whether only `tf.GradientTape`'s own gradients can be had here; the reason is logged."""
        if tf.executing_eagerly():
            _log_eager_once()
            return True
        values = [*tf.nest.flatten(target), *tf.nest.flatten(sources)]
        odd = [v for v in values if not (_tf.is_resource_variable(v) or isinstance(v, tf.Tensor))]
        target_graph = graph_of(tf.nest.flatten(target))
        if odd:
            reason = f"{odd[0]!r} is not a dense tensor or a variable"
        elif not any(s.graph is target_graph for s in self._spans):
            reason = "the tape recorded nothing in the graph of the target"
        else:
            return False
        logger.warning("GradientTape computes plain gradients, saving nothing: %s.", reason)
        return True

    def _checkpointed_gradients(self, targets, sources, output_gradients, unconnected):
        graph = graph_of(targets)
        with graph.as_default():
            xs = [_as_graph_tensor(s) for s in sources]
            tracked = self._tracked(graph)
            connected = list({x.ref(): x for x in xs if x.ref() in tracked}.values())
            found = {}
            if connected:
                grad_ys = None
                if output_gradients is not None:
                    grad_ys = [
                        None if g is None else tf.convert_to_tensor(g)
                        for g in tf.nest.flatten(output_gradients)
                    ]
                stops = _unrecorded_between(connected, targets, tracked)
                grads = gradients(
                    targets, connected, grad_ys, self.checkpoints,
                    gradients_held=self.gradients_held, update_scratch=self.update_scratch,
                    costs=self.costs, stop_gradients=stops,
                    unconnected_gradients=unconnected,
                )  # fmt: skip
                found = {x.ref(): g for x, g in zip(connected, grads, strict=True)}
            return [unconnected_filled(x, found.get(x.ref()), unconnected) for x in xs]

    def _tracked(self, graph: tf.Graph) -> set:
        """Refs of the tensors the tape can differentiate against: those watched and every
        output of a recorded op."""
        operations = graph.get_operations()
        during = {
            op
            for span in self._spans
            if span.graph is graph
            for op in operations[span.start : span.end]
        }
        watched = [
            _as_graph_tensor(t) for t in [*self._watched_tensors, *self.watched_variables()]
        ]
        watched = [t for t in watched if t.graph is graph]
        recorded = queries.forward_ops(watched, within=during)
        return {t.ref() for t in watched} | {out.ref() for op in recorded for out in op.outputs}

    def _open_span(self) -> None:
        if not tf.executing_eagerly():
            current = tf.compat.v1.get_default_graph()
            self._spans.append(_Span(current, len(current.get_operations())))

    def _close_span(self) -> bool:
        """End the open span, if any; whether one was open."""
        if self._spans and self._spans[-1].end is None:
            last = self._spans[-1]
            last.end = len(last.graph.get_operations())
            return True
        return False


@functools.cache
def _log_eager_once() -> None:
    logger.warning(
        "memory_saving_gradients.GradientTape is running eagerly: there is no graph to "
        "rewrite, so it computes plain gradients and saves no memory. Run the training step "
        "inside tf.function (Keras: run_eagerly=False) to checkpoint."
    )


def _as_graph_tensor(value) -> tf.Tensor:
    """`value` in the default graph: a variable as its handle, an outside tensor captured."""
    if _tf.is_resource_variable(value):
        value = value.handle
    return tf.convert_to_tensor(value)


def _unrecorded_between(xs: list[tf.Tensor], ys: list[tf.Tensor], tracked: set) -> list[tf.Tensor]:
    """Outputs of ops on paths from xs to ys that the tape did not record: gradients stop
    there, as on `tf.GradientTape`."""
    downstream = queries.forward_ops(xs)
    between = queries.backward_ops((y.op for y in ys), within=downstream) & downstream
    return [out for op in between for out in op.outputs if out.ref() not in tracked]
