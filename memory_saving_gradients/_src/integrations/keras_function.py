"""The function an enabled model's `fit` calls each step, traced on each batch's own shapes.

Keras traces its training function on its dataset iterator's element spec, whose batch
dimension is unknown, and every shape computed from it is unknown too: plans then have no
sizes to weigh (a reshape by `tf.shape` of a batch can be of any rank and size), and their
predictions are of nothing the step runs. So an enabled model's `train_function` takes each
batch from the iterator as Keras's own `train_on_batch` passes one, and calls the training
step on it: the step is traced once for each batch shape it meets (a dataset's last, partial
batch traces once more), and each trace plans for the sizes it runs at. Under a distribution
strategy of several replicas Keras's own function runs (reducing the replicas' logs is its
own business), planned with the batch unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import keras
import tensorflow as tf


def train_function(model: keras.Model) -> Callable[[Iterator], dict]:
    """`model.train_function` for `fit`, `train_on_batch` and the like: takes an iterator of
    batches, runs `model.steps_per_execution` steps (fewer where it runs out), and returns
    the logs of the last. StopIteration where the iterator has no batch left, as Keras's."""
    if model.distribute_strategy.num_replicas_in_sync > 1:
        type(model).make_train_function(model, force=True)
        return model.train_function

    @tf.autograph.experimental.do_not_convert
    def one_step(data) -> dict:
        return model.distribute_strategy.run(model.train_step, args=(data,))

    step = tf.function(one_step, jit_compile=model.jit_compile)

    def function(iterator: Iterator) -> dict:
        logs = step(next(iterator))
        for _ in range(model.steps_per_execution - 1):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break
            logs = step(data)
        return logs

    return function
