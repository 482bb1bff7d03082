"""Model zoo: on real architectures (_src/models/zoo.py), checkpointed gradients of a training loss
equal tf.gradients' to float32 round-off, under every strategy, with TensorFlow's graph
optimizers (and oneDNN's fusions) on.

The reference and the checkpointed gradients come from two separate tf.functions: reference
gradient ops in the same graph change what grappler fuses, so only separate graphs test the
graphs users run. Each run first restores the model's variables (batch-norm statistics, Keras
dropout seed generators), so both runs see the same state and draw the same dropout masks.
The one exception is the MLP, whose dropout is an unseeded stateful random op: two functions
would draw two masks, so its reference and checkpointed gradients share one function call
(which also checks that its mask is never redrawn by a recomputation).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import zoo
from tests.helpers import assert_same_gradients, dense, recomputed_copies

tf1 = tf.compat.v1
STRATEGIES = ["memory", "balanced", "speed", "collection", "list", "budget_0.5"]
#: float32 round-off, relative to each gradient's largest entry (or the model's largest).
RTOL = 1e-5


def checkpoints_for(strategy: str, taps: list[tf.Tensor]):
    """The `checkpoints` argument: 'collection' adds every other layer output to the graph's
    collection, 'list' passes the others."""
    if strategy == "collection":
        for tap in taps[::2]:
            msg.add_checkpoint(tap)
    if strategy == "list":
        return taps[1::2] or taps
    if strategy == "budget_0.5":
        return msg.MemoryBudget(0.5)
    return strategy


@functools.cache
def built(name: str) -> zoo.ZooModel:
    return zoo.ALL[name]()


def run(model: zoo.ZooModel, strategy: str | None, tape: bool = False) -> dict:
    """One call of a fresh tf.function: 'reference' (tf.gradients) when `strategy` is None,
    else 'got' (msg.gradients, or msg.GradientTape's gradient if `tape`), and both for a
    `one_function` model; 'recomputed', the number of forward ops the rewrite copied."""
    model.restore()
    traced = {}

    @tf.function
    def step(*inputs):
        recorded = msg.GradientTape(checkpoints=strategy) if tape else contextlib.nullcontext()
        with recorded:
            loss, taps = model.forward(*inputs)
        out = {}
        if strategy is None or model.one_function:
            out["reference"] = tf.gradients(loss, model.trainable)
        if strategy is not None:
            checkpoints = checkpoints_for(strategy, taps)
            traced["pays"] = msg.plan(loss, model.trainable, checkpoints=checkpoints).pays
            if tape:
                out["got"] = recorded.gradient(loss, model.trainable)
            else:
                out["got"] = msg.gradients(loss, model.trainable, checkpoints=checkpoints)
            traced["recomputed"] = len(recomputed_copies(tf1.get_default_graph()))
        return out

    values = step(*model.inputs)
    result = {
        key: [g if g is None or isinstance(g, tf.IndexedSlices) else g.numpy() for g in grads]
        for key, grads in values.items()
    }
    result.update(traced)
    return result


@functools.cache
def reference(name: str) -> list[np.ndarray]:
    return run(built(name), None)["reference"]


def assert_close_to_scale(want, have, rtol=RTOL) -> None:
    """Each gradient equal to `rtol` of its own largest entry, or of the model's largest where
    it is (analytically) zero, as a bias right before batch normalization is."""
    scale = max(float(np.abs(dense(w)).max()) for w in want)
    assert_same_gradients(want, have, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(zoo.ALL))
def test_zoo_gradients_match_tf_gradients(name, strategy):
    model = built(name)
    result = run(model, strategy)
    want = result["reference"] if model.one_function else reference(name)
    assert len(result["got"]) == len(want) == len(model.trainable)
    assert all(g is not None for g in want), "a trainable variable gets no gradient"
    assert (result["recomputed"] > 0) == result["pays"], result
    assert_close_to_scale(want, result["got"])


@pytest.mark.parametrize("name", list(zoo.ALL))
def test_zoo_gradient_tape_matches_tf_gradients(name):
    """msg.GradientTape in place of tf.GradientTape, 'memory'."""
    model = built(name)
    result = run(model, "memory", tape=True)
    want = result["reference"] if model.one_function else reference(name)
    assert result["recomputed"] > 0, "nothing recomputed"
    assert_close_to_scale(want, result["got"])


@pytest.mark.parametrize("checkpoints", ["balanced", msg.MemoryBudget(0.5)], ids=repr)
def test_budget_without_recomputable_ops_gives_plain_gradients(checkpoints):
    """Found by the property tests (was an IndexError): ys made from xs by stateful ops only
    (here one call of a tf.function layer reading a variable). 'memory' gives plain
    gradients there, and so must a budget."""
    w = tf.Variable([[0.5, 0.1], [0.2, 0.3]])

    @tf.function
    def layer(h):
        return tf.matmul(h, w)

    @tf.function(autograph=False)
    def step(x):
        return tf.gradients(layer(x), x), msg.gradients(layer(x), x, checkpoints=checkpoints)

    want, have = step(tf.ones([1, 2]))
    assert_same_gradients([want[0].numpy()], [have[0].numpy()])
