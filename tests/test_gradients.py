"""Checkpointed gradients equal tf.gradients on every supported model and strategy."""

import numpy as np
import pytest

from tests import models
from tests.helpers import assert_same_gradients, gradients_in_function, gradients_in_session

STRATEGIES = ["memory", "speed", "collection", "list"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", sorted(models.ALL))
def test_session_gradients_equal_tf_gradients(model_name, strategy):
    reference, got = gradients_in_session(models.ALL[model_name], strategy)
    assert_same_gradients(reference, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", sorted(models.ALL))
def test_function_gradients_equal_tf_gradients(model_name, strategy):
    reference, got = gradients_in_function(models.ALL[model_name], strategy)
    assert_same_gradients(reference, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_with_respect_to_the_input_too(strategy):
    reference, got = gradients_in_session(models.residual_chain, strategy, input_gradient=True)
    assert_same_gradients(reference, got)
    reference, got = gradients_in_function(models.tanh_chain, strategy, input_gradient=True)
    assert_same_gradients(reference, got)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_ys_are_backpropagated(strategy):
    seeds = [
        lambda y: np.float32(0.5),
        lambda y: np.float32(-2.0),
        lambda y: np.linspace(-1, 1, int(np.prod(y.shape))).astype(np.float32).reshape(y.shape),
    ]
    reference, got = gradients_in_session(models.several_ys, strategy, grad_ys=seeds)
    assert_same_gradients(reference, got)


def test_embedding_gradient_stays_sparse():
    reference, got = gradients_in_session(models.embedding_model, "memory")
    assert type(got[0]).__name__ == type(reference[0]).__name__ == "IndexedSlicesValue"
