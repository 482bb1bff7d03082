"""The gradient functions backprop uses in place of TensorFlow's (NOTE [softmax gradient in
slices]): the values of TensorFlow's registered gradient, bit for bit where both are built
alike; gradients of models within float32 round-off of `tf.gradients` (whose graph
optimizers treat the two graphs differently), in a function and a Session; the user's graph
left as it was; and the memory they save, measured."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.analysis import gradient_functions
from memory_saving_gradients.profiling import peak_memory
from tests.helpers import assert_same_gradients, run_python

MIB = 2**20
tf1 = tf.compat.v1


@pytest.mark.tf2_only
@pytest.mark.parametrize(
    "shape",
    [(8, 4, 128, 128), (3, 5, 37, 37), (2, 300), (1, 70001), (33, 465)],
    ids=["aligned", "odd-length", "fewer-rows-than-slices", "one-row", "unaligned-rows"],
)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sliced_softmax_gradient_is_tensorflows_bit_for_bit(shape, dtype):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(shape).astype("f4")
    upstream = rng.standard_normal(shape).astype("f4")

    @tf.function
    def both(logits, upstream):
        logits, upstream = tf.cast(logits, dtype), tf.cast(upstream, dtype)
        softmax = tf.nn.softmax(logits)
        (registered,) = tf.gradients(softmax, logits, upstream)  # TensorFlow's own
        return registered, gradient_functions.softmax_gradient(softmax.op, upstream)

    registered, sliced = both(logits, upstream)
    np.testing.assert_array_equal(
        tf.cast(sliced, tf.float32).numpy(), tf.cast(registered, tf.float32).numpy()
    )


@pytest.mark.tf2_only
def test_sliced_softmax_gradient_with_unknown_dimensions():
    """Keras traces `fit`'s step with the batch unknown: the slices' bounds are computed."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 4, 96, 96)).astype("f4")
    upstream = rng.standard_normal((6, 4, 96, 96)).astype("f4")
    spec = tf.TensorSpec([None, 4, None, 96])

    @tf.function(input_signature=[spec, spec])
    def both(logits, upstream):
        softmax = tf.nn.softmax(logits)
        (registered,) = tf.gradients(softmax, logits, upstream)
        return registered, gradient_functions.softmax_gradient(softmax.op, upstream)

    for batch in (6, 0):  # an empty batch has no rows to slice
        registered, sliced = both(logits[:batch], upstream[:batch])
        assert sliced.shape == registered.shape
        np.testing.assert_array_equal(sliced.numpy(), registered.numpy())


@pytest.mark.tf2_only
def test_which_softmaxes_are_differentiated_in_slices():
    graph = tf.Graph()
    with graph.as_default():
        large = tf.nn.softmax(tf.zeros([8, 4, 128, 128]))
        small = tf.nn.softmax(tf.zeros([4, 64, 64]))
        unknown = tf.nn.softmax(tf1.placeholder(tf.float32, [None, 128]))
        with graph.gradient_override_map({"Softmax": "Identity"}):
            overridden = tf.nn.softmax(tf.zeros([8, 4, 128, 128]))
    assert gradient_functions.replacing(large.op) is gradient_functions.softmax_gradient
    assert gradient_functions.replacing(unknown.op) is gradient_functions.softmax_gradient
    assert gradient_functions.replacing(small.op) is None
    assert gradient_functions.replacing(overridden.op) is None

    @tf.function(jit_compile=True)
    def compiled(x):
        softmax = tf.nn.softmax(x)
        assert gradient_functions.replacing(softmax.op) is None  # XLA fuses the product away
        return softmax

    compiled.get_concrete_function(tf.TensorSpec([8, 4, 128, 128]))


def attention_chain(length: int = 256, blocks: int = 3):
    """Variables and loss of `blocks` single-head self-attention blocks over `length` tokens
    (batch 8, width 32): a (8, length, length) softmax each."""
    rng = np.random.default_rng(0)
    weights = [
        tf.Variable((rng.standard_normal((32, 32)) / np.sqrt(32)).astype("f4"))
        for _ in range(blocks)
    ]
    x = tf.constant(rng.standard_normal((8, length, 32)).astype("f4"))

    def loss():
        h = x
        for w in weights:
            probs = tf.nn.softmax(tf.einsum("bqd,bkd->bqk", h @ w, h) / np.sqrt(32.0))
            h = tf.tanh(tf.einsum("bqk,bkd->bqd", probs, h))
        return tf.reduce_sum(tf.square(h))

    return weights, loss


@pytest.mark.tf2_only
@pytest.mark.parametrize("checkpoints", ["speed", "memory"])
def test_gradients_are_tensorflows_and_the_graph_keeps_its_functions(checkpoints):
    weights, loss = attention_chain()
    found = {}

    @tf.function
    def step():
        value = loss()
        reference = tf.gradients(value, weights)
        got = msg.gradients(value, weights, checkpoints=checkpoints)
        graph = tf.compat.v1.get_default_graph()
        operations = graph.get_operations()
        found["own"] = [op._gradient_function for op in operations if op.type == "Softmax"]
        found["sliced"] = [op for op in operations if op.type == "StridedSlice"]
        return reference, got

    reference, got = step()
    assert_same_gradients([r.numpy() for r in reference], [g.numpy() for g in got])
    assert found["own"] and all(function is None for function in found["own"])
    assert found["sliced"]  # the rewrite's gradients took their sums in slices


@pytest.mark.tf2_only
@pytest.mark.parametrize("batch", [8, None], ids=["static", "unknown-batch"])
def test_a_batched_products_larger_operands_gradient_waits_for_the_smallers(batch):
    """Attention's probabilities weighing the values: the probabilities' gradient waits for
    the values', the last reader of the probabilities (NOTE [a product's gradient frees
    before it makes]), and both are TensorFlow's, bit for bit. Products of like operands
    (queries and keys) and products without a batch dimension (a projection) keep
    TensorFlow's gradient."""
    found = {}

    @tf.function
    def gradients(probabilities, values):
        weighed = tf.einsum("bqk,bkd->bqd", probabilities, values)
        scores = tf.matmul(values, values, transpose_b=True)
        projected = tf.einsum("bkd,de->bke", values, tf.ones([16, 16]))
        found["replacing"] = [
            gradient_functions.replacing(t.op) for t in (weighed, scores, projected)
        ]
        upstream = tf.ones_like(weighed)
        ours = gradient_functions.product_gradient(weighed.op, upstream)
        waiting = [
            op for op in tf.compat.v1.get_default_graph().get_operations() if op.control_inputs
        ]
        found["waits"] = [(op.type, [c for c in op.control_inputs]) for op in waiting]
        found["values' gradient"] = ours[1].op
        return ours, tf.gradients(weighed, [probabilities, values], upstream)

    rng = np.random.default_rng(4)
    probabilities = rng.random((8, 512, 512)).astype("f4")
    values = rng.standard_normal((8, 512, 16)).astype("f4")
    spec = [tf.TensorSpec([batch, 512, 512]), tf.TensorSpec([batch, 512, 16])]
    ours, want = gradients.get_concrete_function(*spec)(probabilities, values)
    assert found["replacing"] == [gradient_functions.product_gradient, None, None]
    assert found["waits"] == [("Einsum", [found["values' gradient"]])]
    for got, expected in zip(ours, want, strict=True):
        np.testing.assert_array_equal(got.numpy(), expected.numpy())


@pytest.mark.tf2_only
def test_a_nested_steps_softmaxes_take_their_sums_in_slices_too():
    """Nested recomputation differentiates the outer step's copies of a segment first (the
    inner schedule's last segment): those softmaxes too take the library's gradient, whose
    full-size product `g * s` no row sum reads, as the plan's peak assumes."""
    weights, loss = attention_chain(blocks=8)
    found = {}

    @tf.function
    def step():
        value = loss()
        plan = msg.plan(value, weights, checkpoints="memory")
        found["nested"] = plan.nested
        got = msg.gradients(value, weights, checkpoints=plan)
        found["full_sums"] = [
            op.name
            for op in tf.compat.v1.get_default_graph().get_operations()
            if op.type == "Sum" and "Softmax" in op.name and op.inputs[0].shape == [8, 256, 256]
        ]
        return tf.gradients(value, weights), got

    reference, got = step()
    assert found["nested"]
    assert found["full_sums"] == []
    assert_same_gradients([r.numpy() for r in reference], [g.numpy() for g in got])


@pytest.mark.parametrize(
    "options",
    [{}, {"gate_gradients": True}, {"aggregation_method": tf.AggregationMethod.ADD_N}],
    ids=["default", "gate_gradients", "aggregation_method"],
)
def test_a_tf1_session_gets_tensorflows_values(options):
    graph = tf.Graph()
    with graph.as_default():
        weights, loss = attention_chain(length=256, blocks=2)
        value = loss()
        reference = tf.gradients(value, weights, **options)
        got = msg.gradients(value, weights, checkpoints="speed", **options)
        init = tf1.global_variables_initializer()
    assert any("Softmax_grad/strided_slice" in op.name for op in graph.get_operations())
    with tf1.Session(graph=graph) as session:
        session.run(init)
        expected, computed = session.run([reference, got])
    assert_same_gradients(expected, computed)


def test_a_patched_v1_optimizers_minimize_updates_as_tensorflows():
    """A TF1 program's `GradientDescentOptimizer.minimize`, patched, against unpatched: the
    same weights after a step, the softmaxes' gradients in slices."""

    def trained(patched: bool) -> tuple[list, list[str]]:
        graph = tf.Graph()
        with graph.as_default():
            weights, loss = attention_chain(length=256, blocks=2)
            value = loss()
            optimizer = tf1.train.GradientDescentOptimizer(0.1)
            if patched:
                with msg.patched("memory"):
                    step = optimizer.minimize(value, var_list=weights)
            else:
                step = optimizer.minimize(value, var_list=weights)
            init = tf1.global_variables_initializer()
            sliced = [
                op.name
                for op in graph.get_operations()
                if op.type == "StridedSlice" and "Softmax_grad" in op.name
            ]
        with tf1.Session(graph=graph) as session:
            session.run(init)
            session.run(step)
            return session.run(weights), sliced

    want, unpatched_slices = trained(patched=False)
    have, patched_slices = trained(patched=True)
    assert not unpatched_slices and patched_slices
    assert_same_gradients(want, have)


def softmax_backprop_peaks() -> dict[str, float]:
    """Measured peaks (least of three steps, one inter-op thread) of SGD steps of one
    attention block over 512 tokens (an 8 MiB softmax) by `tf.gradients` and by
    `msg.gradients`, whose plan does not pay there (plain gradients, the softmax's sums in
    slices), with the plan's predictions."""
    weights, loss = attention_chain(length=512, blocks=1)
    plans = []

    def sgd(gradients_of):
        @tf.function
        def step():
            value = loss()
            for w, g in zip(weights, gradients_of(value), strict=True):
                w.assign_sub(1e-6 * g)
            return value

        return step

    def checkpointed(value):
        plans.append(msg.plan(value, weights, checkpoints="memory"))
        return msg.gradients(value, weights, checkpoints="memory")

    plain = sgd(lambda value: tf.gradients(value, weights))
    ours = sgd(checkpointed)
    measured = {
        name: min(peak_memory(step) for _ in range(3)) / MIB
        for name, step in (("tf.gradients", plain), ("msg.gradients", ours))
    }
    plan = plans[0]
    return {
        **measured,
        "predicted tf.gradients": plan.plain_peak_bytes / MIB,
        "predicted msg.gradients": plan.step_peak_bytes / MIB,
        "pays": plan.pays,
    }


_SOFTMAX_BACKPROP_PEAKS = """
import json
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
from tests.test_gradient_functions import softmax_backprop_peaks
print(json.dumps(softmax_backprop_peaks()))
"""


@pytest.mark.tf2_only
def test_sliced_sums_hold_less_than_tensorflows_gradient_and_are_predicted():
    """Backprop of one block holds the softmax, its gradient and, in TensorFlow's gradient,
    their product: three 8 MiB matrices. In slices, an eighth of the product at a time:
    24.5 MiB measured for `tf.gradients`, 17.5 for `msg.gradients` (18.0 predicted)."""
    out = run_python("-c", _SOFTMAX_BACKPROP_PEAKS)
    peaks = json.loads(out.strip().splitlines()[-1])
    softmax = 8 * 512 * 512 * 4 / MIB
    assert not peaks["pays"]
    assert peaks["tf.gradients"] - peaks["msg.gradients"] >= 0.75 * softmax, peaks
    assert abs(peaks["predicted msg.gradients"] / peaks["msg.gradients"] - 1) <= 0.15, peaks


@pytest.mark.parametrize(
    "shape, shared", [((8, 4, 128, 128), 8), ((8, 4, 100, 100), 8), ((3, 1, 301, 301), 7)]
)
def test_the_cost_model_sees_which_slices_share_the_softmaxs_buffer(shape, shared):
    """Slices start at multiples of 32 rows, which a one-dimensional slice shares where both
    its ends lie on 64 bytes: every slice of both tensors, unless the whole softmax's size
    is not a multiple of 16 elements, where the last one is a copy."""
    from memory_saving_gradients._src.analysis import gradient_uses

    graph = tf.Graph()
    with graph.as_default():
        softmax = tf.nn.softmax(tf.zeros(shape))
    use = gradient_uses.gradient_use(softmax.op)
    registered = gradient_uses.gradient_use(softmax.op, registered=True)
    assert use is not registered
    assert not any(step.kind == "StridedSlice" for step in registered.steps)
    slices = [step for step in use.steps if step.kind == "StridedSlice"]
    assert len(slices) == 2 * gradient_functions.SOFTMAX_SLICES
    assert sum(step.aliases for step in slices) == 2 * shared, [s.aliases for s in slices]
