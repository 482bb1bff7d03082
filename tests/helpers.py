"""Run `tf.gradients` and `memory_saving_gradients.gradients` side by side and compare."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.indexed_slices import IndexedSlicesValue

import memory_saving_gradients as msg
from memory_saving_gradients._src.models.graphs import Model
from memory_saving_gradients._src.planning import cut_search

tf1 = tf.compat.v1
ROOT = pathlib.Path(__file__).resolve().parent.parent


def square_weights(n: int, width: int, seed: int = 0) -> list[tf.Variable]:
    """n [width, width] variables named w0, w1, ..., scaled so activations stay of order one."""
    rng = np.random.RandomState(seed)
    return [
        tf.Variable((rng.randn(width, width) / np.sqrt(width)).astype(np.float32), name=f"w{i}")
        for i in range(n)
    ]


def run_python(*arguments: str, env: dict[str, str] | None = None) -> str:
    """Stdout of `python arguments` run from the repository root in a fresh interpreter (for
    device and cluster set-ups that must come before TensorFlow's runtime starts), with `env`
    added to the environment; fails the test with the interpreter's output if it fails."""
    environment = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
    }
    result = subprocess.run(
        [sys.executable, *arguments],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, (result.stdout[-6000:], result.stderr[-4000:])
    return result.stdout


def checkpoints_for(strategy: str, kept: list[tf.Tensor]):
    """The `checkpoints` argument for a strategy name, 'list' meaning the model's own picks."""
    if strategy == "list":
        return kept
    if strategy == "collection":
        for tensor in kept:
            msg.add_checkpoint(tensor)
    return strategy


def gradients_in_session(model_fn, strategy: str, *, input_gradient=False, grad_ys=None):
    """(tf.gradients values, checkpointed values) of one Session run on a fresh graph."""
    with tf.Graph().as_default():
        model: Model = model_fn()
        x = tf1.placeholder(model.x.dtype, model.x.shape)
        ys, kept = model.forward(x)
        xs = [*model.variables, *([x] if input_gradient else [])]
        seeds = (
            None
            if grad_ys is None
            else [tf.constant(g(y)) for g, y in zip(grad_ys, ys, strict=True)]
        )
        reference = tf1.gradients(ys, xs, grad_ys=seeds)
        checkpoints = checkpoints_for(strategy, kept)
        plan = msg.plan(ys, xs, checkpoints=checkpoints, grad_ys=seeds)
        got = msg.gradients(ys, xs, grad_ys=seeds, checkpoints=checkpoints)
        assert_recomputes_where_it_pays(plan)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            return session.run((reference, got), {x: model.x})


def gradients_in_function(model_fn, strategy: str, *, input_gradient=False):
    """(tf.gradients values, checkpointed values) of one call of a tf.function."""
    model: Model = model_fn()

    @tf.function
    def step(x):
        ys, kept = model.forward(x)
        xs = [*model.variables, *([x] if input_gradient else [])]
        reference = tf.gradients(ys, xs)
        checkpoints = checkpoints_for(strategy, kept)
        plan = msg.plan(ys, xs, checkpoints=checkpoints)
        got = msg.gradients(ys, xs, checkpoints=checkpoints)
        assert_recomputes_where_it_pays(plan)
        return reference, got

    return values(step(tf.constant(model.x)))


def values(structure):
    """The values of the tensors in `structure` (None stays None): eagerly, their `.numpy()`;
    under TF1 behaviour, where calling a tf.function adds an op to the default graph, one
    Session run of them, the graph's variables initialized first."""
    leaves = tf.nest.flatten(structure, expand_composites=False)
    if tf.executing_eagerly():
        found = [t.numpy() if isinstance(t, tf.Tensor) else t for t in leaves]
    else:
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            found = iter(session.run([t for t in leaves if t is not None]))
            found = [None if t is None else next(found) for t in leaves]
    return tf.nest.pack_sequence_as(structure, found, expand_composites=False)


def run_in_session(fetches, feed_dict=None):
    """One run of `fetches` in a Session of the default graph, its variables initialized."""
    with tf1.Session() as session:
        session.run(tf1.global_variables_initializer())
        return session.run(fetches, feed_dict)


def run_with_nones(session, gradient_lists, feed_dict=None) -> list[list]:
    """Run lists of gradients in one step; None entries (unconnected xs) stay None."""
    present = [[g for g in gradients if g is not None] for gradients in gradient_lists]
    values = session.run(present, feed_dict)
    return [
        [None if g is None else next(found) for g in gradients]
        for gradients, found in zip(gradient_lists, map(iter, values), strict=True)
    ]


def one_level(view: msg.ForwardView) -> msg.Plan:
    """A policy keeping the one-level cuts with the least predicted peak: 'memory''s plan
    where nesting lowers the peak too little to pay for another forward pass."""
    order = cut_search.Order.of(view, view.costs)
    cuts, _ = cut_search.smallest_peak(order)
    return msg.Plan(view, cut_search.checkpoints_of(order, cuts), "one level")


def recomputed_copies(graph: tf.Graph) -> list[tf.Operation]:
    """The forward ops the rewrite copied, at every level of nesting, not the gradient ops
    TensorFlow names after them."""
    return [op for op in graph.get_operations() if original_of(op) is not None]


def ops_run_for(fetched: Sequence[tf.Tensor]) -> set[tf.Operation]:
    """The ops TensorFlow runs to compute `fetched`, through data and control inputs (a
    Session runs only those; a function's graph is pruned to them)."""
    needed, reached = set(), [t.op for t in fetched]
    while reached:
        op = reached.pop()
        for maker in [t.op for t in op.inputs] + list(op.control_inputs):
            if maker not in needed:
                needed.add(maker)
                reached.append(maker)
    return needed


def original_of(copy: tf.Operation) -> tf.Operation | None:
    """The forward op that `copy` recomputes, or None if `copy` is no recomputed copy. A copy's
    name ends in the original's, after its innermost "recompute_<step>/" scope, and each of
    its inputs is the original's input, or made from it (a copy of its op, a gate passing
    it, a saved tensor's stand-in): its op's name holds the original input's op name, and
    no gradient's. The step's gradient ops are built in the same scope (NOTE [names of
    recomputed ops]), and sums of gradient parts there ("AddN") are named like forward
    ops, but read gradients."""
    parts = re.split(r"recompute_\d+/", copy.name)
    if len(parts) < 2 or "_grad/" in parts[-1]:
        return None
    try:
        original = copy.graph.get_operation_by_name(parts[-1])
    except KeyError:
        return None
    same_inputs = len(copy.inputs) == len(original.inputs) and all(
        source.op.name in read.op.name and "_grad/" not in read.op.name
        for read, source in zip(copy.inputs, original.inputs, strict=True)
    )
    return original if original.type == copy.type and same_inputs else None


def assert_recomputes(graph: tf.Graph) -> None:
    """Fail unless the checkpointed gradients copied some forward ops, so a test comparing
    them with tf.gradients compares a rewrite, not TensorFlow with itself."""
    assert any("/recompute_" in op.name for op in graph.get_operations()), "nothing recomputed"


def assert_recomputes_where_it_pays(plan: msg.Plan) -> None:
    """Fail unless checkpointed gradients copied forward ops exactly where `plan` (made just
    before they were built: TensorFlow's gradients of function calls add outputs to the
    forward ops) pays (`Plan.pays`): elsewhere TensorFlow's own gradients are computed, and
    nothing is copied."""
    graph = tf1.get_default_graph()
    recomputed = any("/recompute_" in op.name for op in graph.get_operations())
    assert recomputed == plan.pays, f"{plan!r}: pays {plan.pays}, recomputed {recomputed}"


def dense(value) -> np.ndarray:
    """A gradient value as a dense array (IndexedSlices values are scattered and summed)."""
    if isinstance(value, (tf.IndexedSlices, IndexedSlicesValue)):
        values, indices = np.asarray(value.values), np.asarray(value.indices)
        out = np.zeros(np.asarray(value.dense_shape), values.dtype)
        np.add.at(out, indices, values)
        return out
    return np.asarray(value)


def assert_same_gradients(reference, got, rtol=1e-5, atol=0.0) -> None:
    """Equal to float round-off, None where tf.gradients gives None, sparse where it is.

    Round-off is measured against each gradient's largest entry, or `atol` where terms that
    cancel to (nearly) zero leave round-off of their own, larger magnitude.
    """
    assert len(reference) == len(got)
    for i, (want, have) in enumerate(zip(reference, got, strict=True)):
        if want is None:
            assert have is None, f"gradient {i}: tf.gradients gives None, got {have}"
            continue
        sparse = (tf.IndexedSlices, IndexedSlicesValue)
        assert isinstance(have, sparse) == isinstance(want, sparse), f"gradient {i} type"
        want, have = dense(want), dense(have)
        wide = np.complex128 if np.iscomplexobj(want) else np.float64
        want, have = want.astype(wide), have.astype(wide)
        scale = float(np.abs(want).max()) or 1.0
        np.testing.assert_allclose(
            have,
            want,
            rtol=rtol,
            atol=max(rtol * scale, atol),
            err_msg=f"gradient {i}",
        )
