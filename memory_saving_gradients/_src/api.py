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

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import arguments
from memory_saving_gradients._src.analysis.arguments import Gradient, TensorLike
from memory_saving_gradients._src.analysis.measured import MeasuredCosts
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning.plans import MIB, Plan
from memory_saving_gradients._src.planning.policies import (
    CheckpointsArg,
    MemoryBudget,
    NoCheckpointsError,
    check_checkpoints,
    plan_for,
)
from memory_saving_gradients._src.rewriting import backprop, enclosing
from memory_saving_gradients._src.rewriting.backprop import GradientOptions, plain_gradients

logger = logging.getLogger(__name__)

_Function = TypeVar("_Function", bound=Callable[..., object])


def _not_converted(function: _Function) -> _Function:
    """`tf.autograph.experimental.do_not_convert`, keeping `function`'s type for users' type
    checkers (TensorFlow has no hints, so its decorators return Any)."""
    return tf.autograph.experimental.do_not_convert(function)


@_not_converted
def gradients(
    ys: TensorLike | Sequence[TensorLike],
    xs: TensorLike | Sequence[TensorLike],
    grad_ys: tf.Tensor | Sequence[tf.Tensor | None] | None = None,
    checkpoints: CheckpointsArg = "collection",
    *,
    gradients_held: bool = False,
    update_scratch: float = 0.0,
    costs: MeasuredCosts | None = None,
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
      ys: what to differentiate; `xs`, `grad_ys`, `name`, `colocate_gradients_with_ops`,
        `gate_gradients`, `aggregation_method`, `stop_gradients` and `unconnected_gradients`
        too are as in `tf.compat.v1.gradients`.
      checkpoints: the tensors to keep, or a strategy: 'collection' (the graph collection
        'checkpoints', see `add_checkpoint`), 'speed' (outputs of matmuls and convolutions),
        'memory' (cuts chosen to minimise the predicted peak memory: one level, about sqrt(2N)
        tensors on an N-layer chain, or nested where that predicts a smaller peak, down to
        O(log N); when none pays off, plain gradients are computed and logged),
        'balanced' ('memory''s peak plus a third of what it saves, for less recomputation),
        a `MemoryBudget` (the least recomputation whose predicted peak fits a fraction of
        plain backprop's, or a number of bytes; nested recomputation below one level's
        least), a `Plan` from `plan`, or a callable given the `ForwardView` that returns the
        tensors to keep (or a Plan). The default is the original TF1 library's, so that code
        written for it, which marks its checkpoints, keeps them; the entry points it never
        had (`GradientTape`, `keras.enable`, `patch`, `plan`) default to 'memory', which
        needs no marking.
      gradients_held: whether the step keeps every gradient until the last one is made: a
        Session fetches them, a function returns them, loss scaling or global-norm clipping
        checks them all before an optimizer applies any. By default plans count on each
        being applied, and freed, as soon as it is made (an optimizer update in the same
        graph); pass True where they are held, so that predicted peaks and budgets count
        them (`keras.enable` decides from the optimizer).
      update_scratch: the temporaries the update applying one gradient holds beside it, as
        a multiple of the gradient's bytes (Adam's two: `keras.enable` measures its
        optimizer's), counted in predicted peaks and budgets where gradients are not held.
      costs: the plain step measured (`measure_costs`): plans from each kernel's measured
        scratch and time instead of the static estimates.

    Returns:
      One gradient per x: a Tensor, an IndexedSlices where `tf.gradients` gives one, or None
      (zeros with unconnected_gradients='zero') for an x that ys do not depend on.

    Raises:
      RuntimeError: called eagerly, outside any graph.
      TypeError, ValueError: ys, xs, grad_ys or checkpoints are not usable; the message names
        the offending value.
      NoCheckpointsError: a checkpoint list, 'collection' or 'speed' gave no usable tensor
        (patched TensorFlow computes its own gradients instead, and logs it).
    """
    options = GradientOptions(
        name, colocate_gradients_with_ops, gate_gradients, aggregation_method
    )
    return compute_gradients(
        ys, xs, grad_ys, checkpoints, options, stop_gradients, unconnected_gradients,
        refuse=True, gradients_held=gradients_held, update_scratch=update_scratch, costs=costs,
    )  # fmt: skip


def compute_gradients(
    ys,
    xs,
    grad_ys,
    checkpoints,
    options: GradientOptions,
    stop_gradients,
    unconnected_gradients,
    *,
    refuse: bool,
    gradients_held: bool = False,
    update_scratch: float = 0.0,
    costs: MeasuredCosts | None = None,
) -> list[Gradient | None]:
    """`gradients`, with its `tf.gradients` options in `options` (their stop_gradients
    aside, which are checked here). Where the strategy finds no
    checkpoint: NoCheckpointsError if `refuse`, else TensorFlow's own gradients (logged), as
    patched TensorFlow computes them for code the user did not write."""
    arguments.check_graph_mode()
    arguments.check_costs(costs)
    arguments.check_update_scratch(update_scratch)
    check_checkpoints(checkpoints)
    args = arguments.parse(ys, xs, grad_ys, stop_gradients, unconnected_gradients)
    with args.graph.as_default():
        gradient_options = dataclasses.replace(options, stop_gradients=args.stop_gradients)
        if args.only_tensorflow or _tf.tape_recording():
            _log_only_tensorflow(args.only_tensorflow)
            return plain_gradients(
                args.ys, args.xs, args.grad_ys, gradient_options, args.unconnected_gradients
            )
        body, outside = enclosing.split(args)
        unique_xs = body.unique_xs
        flowing = body.without_constant_ys()
        grads = [None] * len(unique_xs)
        if flowing.ys:
            grads = _checkpointed(
                flowing, unique_xs, checkpoints, gradient_options, refuse,
                gradients_held, update_scratch, costs,
            )  # fmt: skip
        by_x = {x.ref(): g for x, g in zip(unique_xs, grads, strict=True)}
        by_x.update(outside.gradients(by_x, gradient_options))
        return [unconnected_filled(x, by_x[x.ref()], args.unconnected_gradients) for x in args.xs]


def _checkpointed(
    args: arguments.Arguments,
    unique_xs,
    checkpoints,
    options: GradientOptions,
    refuse: bool,
    gradients_held: bool,
    update_scratch: float,
    costs: MeasuredCosts | None,
) -> list:
    view = ForwardView.build(
        args.ys,
        unique_xs,
        args.grad_ys is not None,
        gradients_held,
        update_scratch=update_scratch,
        measured=costs,
    )
    _report_unreachable(view)
    try:
        plan = plan_for(view, checkpoints)
    except NoCheckpointsError as error:
        if refuse:
            raise
        logger.info("%s Computing TensorFlow's own gradients.", error)
        plan = None
    if plan is None or not plan.pays:
        _report_kept_for_variable_reads(view, plain=True)
        _log_plain(plan, checkpoints)
        return plain_gradients(args.ys, unique_xs, args.grad_ys, options, view=view)
    _report_kept_for_variable_reads(view, plain=False)
    _log_plan(plan)
    return backprop.checkpointed_gradients(plan.schedule_on(view), args.grad_ys, options)


@_not_converted
def plan(
    ys: TensorLike | Sequence[TensorLike],
    xs: TensorLike | Sequence[TensorLike],
    grad_ys: tf.Tensor | Sequence[tf.Tensor | None] | None = None,
    checkpoints: CheckpointsArg = "memory",
    *,
    gradients_held: bool = False,
    update_scratch: float = 0.0,
    costs: MeasuredCosts | None = None,
) -> Plan:
    """What `gradients(ys, xs, grad_ys, checkpoints, gradients_held=..., ...)` would keep, and what
    that is predicted to cost, without building any gradient: print it for a table, pass it
    back as `checkpoints=plan` to use it as it is. The arguments are `gradients`'s, in its
    order; `checkpoints` defaults to 'memory' (`gradients`' default is the original
    library's, for its users' code).

    Raises:
      RuntimeError: called eagerly, outside any graph.
      TypeError, ValueError, NoCheckpointsError: as `gradients`; also ValueError where only
        TensorFlow's own gradients apply (composite values, values captured across
        function boundaries).
    """
    grad_ys, checkpoints = _in_gradients_order(grad_ys, checkpoints)
    arguments.check_graph_mode()
    arguments.check_costs(costs)
    arguments.check_update_scratch(update_scratch)
    check_checkpoints(checkpoints)
    try:
        args = arguments.parse(ys, xs, grad_ys, None, tf.UnconnectedGradients.NONE)
    except (TypeError, ValueError) as error:
        if grad_ys is None or "grad_ys" not in str(error):
            raise
        raise type(error)(
            f"{error} (plan's third argument is grad_ys, as gradients'; if these are "
            "checkpoints, pass checkpoints= by keyword.)"
        ) from error
    if args.only_tensorflow:
        raise ValueError(
            f"No plan: only TensorFlow's own gradients apply here ({args.only_tensorflow})."
        )
    with args.graph.as_default():
        body, _ = enclosing.split(args)
        flowing = body.without_constant_ys()
        view = ForwardView.build(
            flowing.ys,
            body.unique_xs,
            flowing.grad_ys is not None,
            gradients_held,
            update_scratch=update_scratch,
            measured=costs,
        )
        return plan_for(view, checkpoints).predicted()


def _in_gradients_order(grad_ys, checkpoints) -> tuple:
    """`(grad_ys, checkpoints)` of `plan`, from a call in the order `plan` took before it took
    `gradients`'s, `plan(ys, xs, checkpoints, grad_ys)`, with a DeprecationWarning: where the
    third argument can only be checkpoints (a strategy's name, a Plan, a policy, names of
    tensors), and the fourth, if any, is grad_ys. Tensors third are grad_ys, as in
    `gradients`."""
    names = isinstance(grad_ys, list | tuple) and any(isinstance(g, str) for g in grad_ys)
    if not (isinstance(grad_ys, str | Plan) or callable(grad_ys) or names):
        return grad_ys, checkpoints
    warnings.warn(
        "plan's third argument is grad_ys now, as gradients' is (ys, xs, grad_ys, "
        "checkpoints); checkpoints there are deprecated: pass checkpoints= by keyword.",
        DeprecationWarning,
        stacklevel=4,  # past this function, plan and autograph's wrapper of plan
    )
    old_grad_ys = None if isinstance(checkpoints, str) and checkpoints == "memory" else checkpoints
    return old_grad_ys, grad_ys


def _log_only_tensorflow(reason: str | None) -> None:
    """Say why TensorFlow's own gradients are computed: `reason`, or else a tape recording
    this call, which would differentiate these gradients through ops it never saw (and holds
    the whole forward pass for that anyway), a warning as it costs the savings."""
    if reason:
        logger.info("Computing TensorFlow's own gradients: %s.", reason)
    else:
        logger.warning(
            "A GradientTape or ForwardAccumulator is recording this gradient call: it would "
            "not see the recomputed ops, so its gradients of these gradients would be wrong. "
            "Computing TensorFlow's own gradients, which save nothing. Where nothing "
            "differentiates these gradients, take them outside the tape's `with` block (or "
            "under its stop_recording()) to checkpoint them."
        )


def _log_plan(plan: Plan) -> None:
    """Say what `plan` keeps and, where info logging is on, its predicted peaks."""
    logger.info("Checkpointing with %s: %d tensors.", plan.strategy, len(plan.checkpoints))
    logger.debug("Checkpoints: %s", [t.name for t in plan.checkpoints])
    if logger.isEnabledFor(logging.INFO) and plan.checkpoints:
        time = (
            ""
            if plan.time_ratio is None
            else f"; predicted step time {plan.time_ratio:.2f}x plain"
        )
        logger.info(
            "%s: predicted activation peak %.1f MiB, %.1f MiB without checkpoints%s.",
            plan.strategy, plan.peak_bytes / MIB, plan.plain_peak_bytes / MIB, time,
        )  # fmt: skip


def _log_plain(plan: Plan | None, checkpoints: CheckpointsArg) -> None:
    """Say why plain gradients are computed for `plan` (None: the strategy found nothing to
    keep): a warning where the user chose checkpoints that predict no saving, as that choice
    is then not followed."""
    if plan is not None and plan.saved and not plan.checkpoints:
        logger.warning(
            "%s saves %d tensors inside segments but keeps no checkpoint to make segments: "
            "nothing is recomputed, so plain gradients are computed.",
            plan.strategy, len(plan.saved),
        )  # fmt: skip
    elif plan is None or not plan.checkpoints:
        logger.info("No checkpoints chosen: computing plain gradients.")
    elif not plan.recomputes:
        logger.info("%s recomputes nothing: computing plain gradients.", plan.strategy)
    else:
        chosen = not isinstance(checkpoints, str | MemoryBudget)
        (logger.warning if chosen else logger.info)(
            "%s predicts an activation peak of %.1f MiB, not below plain backprop's %.1f MiB: "
            "computing plain gradients.%s",
            plan.strategy, plan.peak_bytes / MIB, plan.fallback_peak_bytes / MIB,
            " checkpoints='memory' chooses checkpoints that pay, or none." if chosen else "",
        )  # fmt: skip


def _report_kept_for_variable_reads(view: ForwardView, plain: bool) -> None:
    """Name the loops, conds and nested tf.functions kept only because they read variables
    inside, which the user can let be recomputed: a warning where nothing is recomputed."""
    kept = view.kept_for_variable_reads
    if kept:
        (logger.warning if plain else logger.info)(
            "%d loops, conds or nested tf.functions are kept, not recomputed (%.1f MiB of "
            "outputs), e.g. %s: they read variables inside, which makes them stateful. Pass the "
            "variables' values in as tensors (tf.convert_to_tensor(variable) outside them) to "
            "let them be recomputed.",
            len(kept), sum(view.bytes(t) for op in kept for t in op.outputs) / MIB,
            [op.name for op in kept[:3]],
        )  # fmt: skip


def _report_unreachable(view: ForwardView) -> None:
    """xs that ys do not depend on get None, as from tf.gradients; say so, never silently."""
    ys = {y.ref() for y in view.ys}
    unreachable = [x.name for x in view.xs if not view.consumers(x) and x.ref() not in ys]
    if len(unreachable) == len(view.xs):
        logger.warning(
            "ys do not depend on any of xs %s: every gradient is None (zeros with "
            "unconnected_gradients='zero'). Check that the loss is computed from them.",
            unreachable,
        )
    elif unreachable:
        logger.info("ys do not depend on xs %s: their gradients are None.", unreachable)


def _with_strategy(strategy: str) -> Callable[..., list[Gradient | None]]:
    def shorthand(
        ys: TensorLike | Sequence[TensorLike],
        xs: TensorLike | Sequence[TensorLike],
        grad_ys: tf.Tensor | Sequence[tf.Tensor | None] | None = None,
        **options,
    ) -> list[Gradient | None]:
        return gradients(ys, xs, grad_ys, strategy, **options)

    shorthand.__name__ = shorthand.__qualname__ = f"gradients_{strategy}"
    shorthand.__doc__ = f"`gradients` with checkpoints={strategy!r}; same keyword arguments."
    return _not_converted(shorthand)


gradients_speed = _with_strategy("speed")
gradients_memory = _with_strategy("memory")
gradients_collection = _with_strategy("collection")


def unconnected_filled(
    x: tf.Tensor, gradient: Gradient | None, unconnected: tf.UnconnectedGradients
) -> Gradient | None:
    """`gradient`, or zeros shaped like `x` where it is None and `unconnected` asks for them."""
    if gradient is None and unconnected == tf.UnconnectedGradients.ZERO:
        return _tf.zero_gradient(x)
    return gradient
