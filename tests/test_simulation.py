"""The simulator's own bookkeeping: what it keeps per view while the planner tries plans."""

import gc
import weakref

import tensorflow as tf

from memory_saving_gradients.analysis.view import ForwardView
from memory_saving_gradients.planning.simulation.numbering import Numbering


def test_a_views_numbering_is_made_once_and_forgotten_with_the_view():
    """Inside a tf.function, where a view's tensors do not hash."""
    forgotten = []

    @tf.function(autograph=False)
    def step(x):
        view = ForwardView.build([tf.tanh(x)], [x])
        numbering = Numbering.of(view)
        assert Numbering.of(view) is numbering
        kept = weakref.ref(numbering)
        del view, numbering
        gc.collect()
        forgotten.append(kept() is None)
        return x

    step.get_concrete_function(tf.TensorSpec([2], tf.float32))
    assert forgotten == [True]
