"""Checkpointed gradients for Keras 3 `model.fit`: `enable(model, checkpoints="memory")`.

Keras's TensorFlow trainer takes its gradients with `tf.GradientTape` inside `train_step`, the
method Keras documents for customising what `fit` does. `enable` gives one model a
`train_step` that does what Keras's does, through public Keras API only, with
`memory_saving_gradients.GradientTape` in place of `tf.GradientTape`: forward pass,
`compute_loss`, the "loss" metric, `optimizer.scale_loss` (mixed precision: the
LossScaleOptimizer unscales in `apply_gradients`), `compute_metrics`. `evaluate` and `predict`
are Keras's own. Plans count on what the optimizer does with the gradients: a plain update
applies each as soon as it is made, holding temporaries of its own beside it (measured once
per optimizer: `keras_updates`), while loss scaling, global-norm clipping, gradient
accumulation and the all-reduce of several replicas hold them all until the last is made.
The step also makes each variable's update wait for its gradient, so that optimizer state
computed from the old state alone (momentum times velocity) is not held through the whole step
(NOTE [updates after gradients]): with SGD momentum that is as many bytes again as the weights.

With `measure=True`, the first step of `fit` runs Keras's own plain step under TensorFlow's
profiler (`measure_costs`), and the steps after it plan from what that measured: kernels'
scratch the static estimates do not know (Keras 3 runs grouped and depthwise convolutions on
CPU as XLA-compiled functions, whose gradients hold scratch of their own), and kernels' times.
That step trains as any other; it costs one more trace and about a second per thousand ops.

`model.checkpoint_plan` is the plan of the step's latest trace (None before it is traced):
what it keeps, and its predicted peaks with and without checkpoints, which `MemoryLog` adds
to the training log beside the measured one. `layer_outputs` picks checkpoints by layer.

With `jit_compile=True` the training step stays compiled by XLA and keeps its savings (the
recomputation reads its inputs through a data dependency XLA keeps: NOTE [gates under XLA] in
`_tf`). With `run_eagerly=True` there is no graph to rewrite: the step computes plain
gradients, which is logged.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import types
from collections.abc import Iterator
from typing import TypeVar

import keras
import tensorflow as tf

from memory_saving_gradients._src.analysis.measured import MeasuredCosts
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.integrations import keras_function, keras_updates
from memory_saving_gradients._src.integrations.keras_layers import (
    LayerOutputs,
    layer_outputs,
    layers_of,
)
from memory_saving_gradients._src.integrations.keras_memory_log import MemoryLog
from memory_saving_gradients._src.integrations.tape import GradientTape
from memory_saving_gradients._src.planning.plans import Plan
from memory_saving_gradients._src.planning.policies import (
    CheckpointsArg,
    Strategy,
    check_checkpoints,
    plan_for,
)
from memory_saving_gradients._src.profiling import measure_costs

__all__ = ["LayerOutputs", "MemoryLog", "enable", "layer_outputs"]

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=keras.Model)


def enable(
    model: ModelT, checkpoints: CheckpointsArg = "memory", *, measure: bool = False
) -> ModelT:
    """Make `model.fit` compute checkpointed gradients; returns `model`.

    `checkpoints` is any value `gradients` takes, 'memory' by default (`gradients` defaults
    to the original library's 'collection', for code written for it). Works on built and
    unbuilt models, before or after `compile`; calling it again changes
    `checkpoints`. A model saved and loaded again needs `enable` again. With `measure`, the
    first step of `fit` is a plain step, measured, and the plans of the steps after it use
    its costs (`model.measured_costs` then holds them). `model.checkpoint_plan` holds the
    plan of the latest trace of the step. A `layer_outputs` policy is checked against the
    model's layers here.

    Raises:
      RuntimeError: Keras does not run on the TensorFlow backend.
      TypeError: `model` is not a Keras 3 model, or its class defines its own `train_step`
        (use `memory_saving_gradients.GradientTape` there instead of `tf.GradientTape`).
      ValueError: `checkpoints` names no strategy, or is a `layer_outputs` policy naming no
        layer of `model`.
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"memory_saving_gradients rewrites TensorFlow graphs, but Keras runs on the "
            f"{keras.backend.backend()!r} backend; set KERAS_BACKEND=tensorflow."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(f"enable() takes a keras.Model, got {model!r}.")
    if type(model).train_step is not keras.Model.train_step:
        raise TypeError(
            f"{type(model).__name__} defines its own train_step, which enable() would replace: "
            "use memory_saving_gradients.GradientTape there instead of tf.GradientTape."
        )
    check_checkpoints(checkpoints)
    chosen = checkpoints.bound_to(model) if isinstance(checkpoints, LayerOutputs) else checkpoints
    recorded = _recording_plans(model, chosen)
    model.train_step = types.MethodType(_checkpointed_train_step(recorded), model)
    model.measured_costs = None
    model.checkpoint_plan = None
    model.make_train_function = types.MethodType(
        _measuring_train_function(recorded) if measure else _make_train_function, model
    )
    model.train_function = None
    logger.info(
        "Keras model %s: fit computes gradients with checkpoints=%r.", model.name, checkpoints
    )
    return model


def _checkpointed_train_step(checkpoints: CheckpointsArg, costs: MeasuredCosts | None = None):
    """Keras's training step, with the checkpointed tape (planning from `costs`)."""

    def train_step(model: keras.Model, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        held = _gradients_held(model.optimizer)
        scratch = 0.0 if held else keras_updates.update_scratch(model.optimizer)
        with GradientTape(
            checkpoints=checkpoints, gradients_held=held, update_scratch=scratch, costs=costs
        ) as tape:
            y_pred = model(x, training=True) if _call_takes_training(model) else model(x)
            loss = _compute_loss(model, x, y, y_pred, sample_weight)
            scaled_loss = loss if model.optimizer is None else model.optimizer.scale_loss(loss)
        _loss_metric(model).update_state(_undo_replica_scaling(loss), sample_weight=_batch_size(x))
        weights = model.trainable_weights
        if weights:
            gradients = tape.gradient(scaled_loss, weights)
            with _updates_after_gradients(model.optimizer, gradients, weights):
                model.optimizer.apply_gradients(zip(gradients, weights, strict=True))
        else:
            logger.warning("Keras model %s has no trainable weights to train.", model.name)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step


# NOTE [updates after gradients]: an optimizer's update may compute part of its new state
# from the old state alone: SGD's momentum times the velocity, RMSprop's rho times its mean
# square. Nothing in the graph makes those ops wait for the gradient, so the executor runs them
# as soon as the step starts, and each holds a buffer the size of its variable until the
# gradient arrives at the end of backprop: every variable's worth at the peak
# (tests/test_keras.py, momentum's temporaries). Each variable's update
# step is therefore traced under a control dependency on the gradient as backprop made it
# (Keras passes it on through the all-reduce of its distribution strategy, an IdentityN of
# every gradient: a control dependency on that would make every update wait for the last).
# Decoupled weight decay (AdamW) reads only the variable: left free, every variable's decay
# ran as the step started, each making a temporary of its variable's size and, as the
# forward pass still read the variable, a copy of it. It waits for the variable's gradient
# too (tests/test_keras.py, weight decay).
@contextlib.contextmanager
def _updates_after_gradients(
    optimizer: keras.optimizers.Optimizer,
    gradients: list[tf.Tensor | None],
    weights: list[keras.Variable],
) -> Iterator[None]:
    """While `optimizer` applies `gradients`, each variable's `update_step` (Keras's documented
    per-variable hook) runs after that variable's gradient is made. Under several replicas
    the all-reduce orders them; nothing changes there."""
    if tf.distribute.get_strategy().num_replicas_in_sync > 1:
        yield
        return
    made = {
        id(_as_tf_variable(weight)): gradient
        for weight, gradient in zip(weights, gradients, strict=True)
        if gradient is not None
    }
    optimizers = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    wrapped = [o for o in optimizers if o is not None and "update_step" not in vars(o)]
    for wrapped_optimizer in wrapped:
        update_step = _fused_momentum_step(wrapped_optimizer) or wrapped_optimizer.update_step
        wrapped_optimizer.update_step = _after_gradient(update_step, made)
        if wrapped_optimizer.weight_decay:
            wrapped_optimizer._apply_weight_decay = _decay_after_gradients(
                wrapped_optimizer._apply_weight_decay, made
            )
    try:
        yield
    finally:
        for wrapped_optimizer in wrapped:
            del wrapped_optimizer.update_step
            vars(wrapped_optimizer).pop("_apply_weight_decay", None)


def _after_gradient(update_step, made: dict[int, tf.Tensor]):
    """`update_step` traced under a control dependency on its variable's gradient in `made`
    (by the variable's id)."""

    def update_step_after_gradient(gradient, variable, learning_rate):
        own = made.get(id(_as_tf_variable(variable)))
        if own is None:
            logger.debug("No gradient of %s to order its update after.", variable.name)
            return update_step(gradient, variable, learning_rate)
        with tf.control_dependencies([own]):
            return update_step(gradient, variable, learning_rate)

    return update_step_after_gradient


def _decay_after_gradients(apply_weight_decay, made: dict[int, tf.Tensor]):
    """Keras's decoupled weight decay (AdamW's, `variable -= variable * decay * rate`, applied
    to every variable before any update: `Optimizer._apply_weight_decay`, the one method of
    Keras's update without a public per-variable hook) applied to each variable under a
    control dependency on its gradient in `made` (by the variable's id)."""

    def apply_weight_decay_after_gradients(variables):
        for variable in variables:
            own = made.get(id(_as_tf_variable(variable)))
            with tf.control_dependencies([] if own is None else [own]):
                apply_weight_decay([variable])

    return apply_weight_decay_after_gradients


# NOTE [fused momentum]: Keras's SGD with momentum updates a variable in five kernels
# (momentum * velocity, rate * gradient, their difference, its assignment to the velocity,
# its addition to the variable), each result a buffer the size of the variable. The executor
# runs the first as soon as the gradient exists, then may run backprop's next ops first, so
# the updates begun wait half done, each holding its buffers. TensorFlow's
# ResourceApplyKerasMomentum is
# the same update, defined by Keras's formula (velocity = momentum * velocity - rate *
# gradient; variable += velocity, or += momentum * velocity - rate * gradient with
# Nesterov), in one kernel that writes both variables in place.
def _fused_momentum_step(optimizer: keras.optimizers.Optimizer):
    """Keras's SGD momentum `update_step` as one kernel (NOTE [fused momentum]), for a plain
    `keras.optimizers.SGD` with momentum; None for any other optimizer, subclasses included.
    Finds each variable's velocity by Keras's `_get_variable_index`."""
    if type(optimizer) is not keras.optimizers.SGD or not optimizer.momentum:
        return None

    def fused_update_step(gradient, variable, learning_rate):
        velocity = optimizer.momentums[optimizer._get_variable_index(variable)]
        dtype = variable.dtype
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=_as_tf_variable(variable).handle,
            accum=_as_tf_variable(velocity).handle,
            lr=tf.cast(learning_rate, dtype),
            grad=tf.cast(gradient, dtype),
            momentum=tf.cast(optimizer.momentum, dtype),
            use_nesterov=optimizer.nesterov,
        )

    return fused_update_step


def _as_tf_variable(variable):
    """The TensorFlow variable a Keras variable holds (Keras's TensorFlow optimizers update
    those); a TensorFlow variable as it is."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _recording_plans(model: keras.Model, checkpoints: CheckpointsArg) -> Strategy:
    """`checkpoints` as a policy that also keeps its plan as `model.checkpoint_plan`, its
    predictions made before the gradients are built (as `plan` makes them). The one
    difference from passing `checkpoints` itself: where a named strategy or budget gives a
    plan that recomputes and does not pay, that is logged as a warning, as for a policy of
    one's own, not at INFO."""

    def policy(view: ForwardView) -> Plan:
        plan = plan_for(view, checkpoints).predicted()
        model.checkpoint_plan = plan
        return plan

    return policy


def _gradients_held(optimizer: keras.optimizers.Optimizer | None) -> bool:
    """Whether `optimizer` keeps every gradient until the last one is made before applying
    any: loss scaling checks them all for overflow, global-norm clipping and gradient
    accumulation read them all, and an all-reduce over several replicas takes them together."""
    return (
        optimizer is None
        or isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        or bool(optimizer.global_clipnorm)
        or bool(optimizer.gradient_accumulation_steps)
        or tf.distribute.get_strategy().num_replicas_in_sync > 1
    )


def _make_train_function(model: keras.Model, force: bool = False):
    """`make_train_function`: a function tracing the step on each batch's own shapes
    (`keras_function`), or Keras's own where the model runs eagerly, which is logged as the
    step then cannot save memory."""
    if model.train_function is not None and not force:
        return model.train_function
    _build_optimizer(model)
    _measure_update_scratch(model)
    if model.run_eagerly:
        logger.warning(
            "Keras model %s runs eagerly (run_eagerly=True): there is no graph to rewrite, so "
            "fit computes plain gradients and saves no memory. Compile with "
            "run_eagerly=False to checkpoint.",
            model.name,
        )
        return type(model).make_train_function(model, force)
    model.train_function = keras_function.train_function(model)
    return model.train_function


def _measuring_train_function(checkpoints: CheckpointsArg):
    """`make_train_function` whose function measures its first call as a plain step
    (Keras's own `train_step`), then makes the checkpointed one from those costs and hands
    every later call to it. `fit` calls `model.train_function` anew each step."""

    def make_train_function(model: keras.Model, force: bool = False):
        if getattr(model, "measured_costs", None) is not None:
            return _make_train_function(model, force)
        if model.train_function is not None and not force:
            return model.train_function
        _build_optimizer(model)
        _measure_update_scratch(model)
        # Plain gradients through the tape, named as `tf.gradients` names them, which
        # charges each gradient op to its forward op (`measured`); TensorFlow's own tape
        # names a function call's gradient after nothing it differentiates.
        model.train_step = types.MethodType(_checkpointed_train_step(_keep_nothing), model)
        plain = _make_train_function(model, force=True)

        def first_step(data):
            logs = []
            costs = measure_costs(
                lambda: logs.append(plain(data)), _step_device(), warmup=0, repeats=0
            )
            logger.info("Keras model %s: %s", model.name, costs.report(5))
            model.measured_costs = costs
            model.train_step = types.MethodType(
                _checkpointed_train_step(checkpoints, costs), model
            )
            _make_train_function(model, force=True)
            return logs[0]

        model.train_function = first_step
        return first_step

    return make_train_function


def _build_optimizer(model: keras.Model) -> None:
    """Make the optimizer's variables before the step is traced, once the model's exist
    (every layer built), under the model's distribution strategy. Keras leaves that to the
    optimizer's first `apply`, inside the traced step, and a `tf.function` whose first trace
    makes variables is traced again: the step would be planned twice. An unbuilt model's
    are left to Keras."""
    optimizer = model.optimizer
    if optimizer is None or optimizer.built:
        return
    if all(layer.built for layer in layers_of(model)):
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)


def _measure_update_scratch(model: keras.Model) -> None:
    """Measure what the optimizer's update holds beside each gradient (`keras_updates`), as
    the train function is made, before any step runs."""
    if model.optimizer is not None and not _gradients_held(model.optimizer):
        keras_updates.measure(model.optimizer, _step_device(), _updates_after_gradients)


def _step_device() -> str:
    """The device whose allocator holds the step's tensors: the first GPU, else the CPU."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _keep_nothing(view: ForwardView) -> Plan:
    return Plan(view, [()], "plain, measured")


def _call_takes_training(model: keras.Model) -> bool:
    """Whether `model.call` takes `training`; Keras's own step passes it only then."""
    return "training" in inspect.signature(model.call).parameters


def _compute_loss(model: keras.Model, x, y, y_pred, sample_weight):
    """`model.compute_loss` in training mode (overrides written before Keras 3.3 take no
    `training` argument)."""
    if "training" in inspect.signature(model.compute_loss).parameters:
        return model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)


def _loss_metric(model: keras.Model) -> keras.metrics.Metric:
    """The metric a compiled model reports as "loss" (Keras's documented lookup by name)."""
    for metric in model.metrics:
        if metric.name == "loss":
            return metric
    raise RuntimeError(
        f"Keras model {model.name} has no 'loss' metric: compile it before fit "
        "(or this Keras version tracks the loss differently; please report it)."
    )


def _undo_replica_scaling(loss: tf.Tensor) -> tf.Tensor:
    """The loss of the global batch: under tf.distribute Keras divides each replica's loss by
    the number of replicas, which the reported loss undoes."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss * tf.cast(replicas, loss.dtype) if replicas > 1 else loss


def _batch_size(x) -> tf.Tensor:
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return tf.shape(first)[0]
