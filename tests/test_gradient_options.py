"""Every `tf.gradients` option, under every kind of plan, in every graph mode.

A twelve-layer swish MLP with biases: deep enough that 'memory' nests recomputation, with
cheap ops that 'speed' and a budget recompute. Each option is passed to `tf.gradients` and to
`gradients` alike, in a Session graph and in a tf.function (and, in the TF1 slice, under
`disable_v2_behavior()`), and the two must agree. `EXPERIMENTAL_ACCUMULATE_N` is the same
as `EXPERIMENTAL_TREE` on TensorFlow 2.21, which stands for both. `gate_gradients` groups each
op's input gradients behind one `group_deps`, which the rewrite's own ordering must respect
(a cycle of 300 nodes once did).
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from tests.helpers import assert_recomputes_where_it_pays, assert_same_gradients, values

tf1 = tf.compat.v1
DEPTH, WIDTH, BATCH = 12, 64, 256

OPTIONS = {
    "gate_gradients": {"gate_gradients": True},
    "aggregation_tree": {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE},
    "not_colocated": {"colocate_gradients_with_ops": False},
    "stop_gradients": {"stop_gradients": "the fourth layer's output"},
    "unconnected_zero": {"unconnected_gradients": "zero"},
    "all_at_once": {
        "gate_gradients": True,
        "aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE,
        "colocate_gradients_with_ops": False,
        "stop_gradients": "the fourth layer's output",
        "unconnected_gradients": "zero",
        "name": "my_gradients",
    },
}
STRATEGIES = {
    "memory": lambda: "memory",
    "speed": lambda: "speed",
    "budget": lambda: msg.MemoryBudget(0.5),
}


class SwishMLP:
    """Weights, biases, and one variable the loss never reads (its gradient is unconnected)."""

    def __init__(self):
        rng = np.random.RandomState(0)
        self.weights = [
            tf1.Variable((rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32))
            for _ in range(DEPTH)
        ]
        self.biases = [tf1.Variable(np.full(WIDTH, 0.1, np.float32)) for _ in range(DEPTH)]
        self.unused = tf1.Variable(1.0)
        self.x = rng.randn(BATCH, WIDTH).astype(np.float32)

    @property
    def variables(self):
        return [*self.weights, *self.biases, self.unused]

    def loss(self, x):
        h, hidden = x, []
        for w, b in zip(self.weights, self.biases, strict=True):
            a = tf.matmul(h, w) + b
            h = a * tf.sigmoid(a)
            hidden.append(h)
        return tf.reduce_mean(tf.square(h)), hidden


def both_gradients(model, x, strategy, option):
    """(tf.gradients, checkpointed gradients) of `model`'s loss, with `option` passed to both,
    and the plan `gradients` followed."""
    loss, hidden = model.loss(x)
    options = dict(OPTIONS[option])
    if "stop_gradients" in options:
        options["stop_gradients"] = [hidden[3]]
    checkpoints = STRATEGIES[strategy]()
    reference = tf1.gradients(loss, model.variables, **options)
    plan = msg.plan(loss, model.variables, checkpoints=checkpoints)
    got = msg.gradients(loss, model.variables, checkpoints=checkpoints, **options)
    return reference, got, plan


def check_plan(plan, strategy):
    """The plan recomputes (so the rewrite, not TensorFlow, is compared), nesting for 'memory'."""
    assert plan.pays, plan
    assert_recomputes_where_it_pays(plan)
    if strategy == "memory":
        assert plan.nested, plan


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_option_in_a_session(strategy, option):
    with tf.Graph().as_default():
        model = SwishMLP()
        x = tf1.placeholder(tf.float32, model.x.shape)
        reference, got, plan = both_gradients(model, x, strategy, option)
        check_plan(plan, strategy)
        assert [g is None for g in got] == [g is None for g in reference]
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            present = [(r, g) for r, g in zip(reference, got, strict=True) if r is not None]
            want, have = session.run(list(zip(*present, strict=True)), {x: model.x})
    assert_same_gradients(want, have)


@pytest.mark.tf2_only  # under TF1 behaviour the Session tests cover the same graphs
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_option_in_a_function(strategy, option):
    model = SwishMLP()
    plans = []

    @tf.function
    def step(x):
        reference, got, plan = both_gradients(model, x, strategy, option)
        check_plan(plan, strategy)
        plans.append(plan)
        keep = [r is not None for r in reference]
        assert [g is not None for g in got] == keep
        return (
            [r for r, k in zip(reference, keep, strict=True) if k],
            [g for g, k in zip(got, keep, strict=True) if k],
        )

    want, have = values(step(tf.constant(model.x)))
    assert plans
    assert_same_gradients(want, have)


OPTIMIZERS = {
    "adam": lambda: tf1.train.AdamOptimizer(1e-2),
    "gradient_descent": lambda: tf1.train.GradientDescentOptimizer(1e-2),
    "momentum": lambda: tf1.train.MomentumOptimizer(1e-2, 0.9),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_patched_v1_minimize_gates_gradients_as_tensorflow_does(optimizer):
    """`Optimizer.minimize` passes gate_gradients=GATE_OP; with 'memory' nesting on this
    model, the variables after two steps equal those of TensorFlow's own gradients."""

    def train(patched: bool):
        with tf.Graph().as_default() as graph:
            model = SwishMLP()
            x = tf1.placeholder(tf.float32, model.x.shape)
            loss, _ = model.loss(x)
            trained = [*model.weights, *model.biases]
            if patched:
                with msg.patched("memory"):
                    step = OPTIMIZERS[optimizer]().minimize(loss, var_list=trained)
                assert any("/recompute_" in op.name for op in graph.get_operations())
            else:
                step = OPTIMIZERS[optimizer]().minimize(loss, var_list=trained)
            with tf1.Session() as session:
                session.run(tf1.global_variables_initializer())
                for _ in range(2):
                    session.run(step, {x: model.x})
                return session.run(trained)

    assert_same_gradients(train(patched=False), train(patched=True))


@pytest.mark.parametrize("gate_gradients", [False, True])
def test_a_mean_reached_before_its_sum_waits_for_the_forward_pass(gate_gradients):
    """Keras's loss is `div_no_nan(sum, count)`, whose gradient for the sum reads the count
    alone: the step recomputing the segment behind a kept sum is reached before the forward
    pass has made it, and its gate waits for the sum's forward op (NOTE [gates]). In a Session,
    with either `gate_gradients`, and through a patched v1 `minimize`: TensorFlow's gradients,
    and weights after two steps equal to its own."""

    def build(patched: bool):
        model = SwishMLP()
        x = tf1.placeholder(tf.float32, model.x.shape)
        _, hidden = model.loss(x)
        total = tf.reduce_sum(tf.square(hidden[-1]))
        loss = tf.math.divide_no_nan(total, float(BATCH))
        kept = [hidden[3], hidden[7], total]
        trained = [*model.weights, *model.biases]
        if not patched:
            grads = tf1.gradients(loss, trained, gate_gradients=gate_gradients)
            return x, model, trained, grads, tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        grads = msg.gradients(loss, trained, checkpoints=kept, gate_gradients=gate_gradients)
        waiting = [op for op in loss.graph.get_operations() if total.op in op.control_inputs]
        assert waiting, "no step waits for the forward pass"
        with msg.patched(kept):
            step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return x, model, trained, grads, step

    results = []
    for patched in (False, True):
        with tf.Graph().as_default():
            x, model, trained, grads, step = build(patched)
            with tf1.Session() as session:
                session.run(tf1.global_variables_initializer())
                gradients = session.run(grads, {x: model.x})
                for _ in range(2):
                    session.run(step, {x: model.x})
                results.append((gradients, session.run(trained)))
    assert_same_gradients(results[0][0], results[1][0])
    assert_same_gradients(results[0][1], results[1][1])


def scaled_attention_loss(weights, x):
    """Blocks of attention scaling its logits after the query-key product (as
    `keras.ops.dot_product_attention` does), whose backprop TensorFlow's optimizers would
    reorder (NOTE [products reassociated ahead] in `ordering.py`)."""
    h = x
    for w in weights:
        q, k, v = tf.split(tf.einsum("bsd,de->bse", h, w), 3, axis=-1)
        logits = tf.einsum("bqd,bkd->bqk", q, k) * 16**-0.5
        h = h + tf.einsum("bqk,bkd->bqd", tf.nn.softmax(logits), v)
    return tf.reduce_sum(h * h)


@pytest.mark.parametrize("scope, ahead", [("block", 0), ("z", 3)])
def test_plain_backprops_products_moved_ahead_are_predicted_in_a_session(scope, ahead):
    """In a Session graph (and under TF1 behaviour), `tf.gradients`' partition graphs hold a
    softmax multiplied by its scale per block where the forward ops' names sort after the
    gradients' (`z/...`), the mirror of a function's graph (NOTE [products ahead in plain
    backprop]), and plain's predicted peak counts exactly those, over the peak of the plain
    gradients `gradients` computes."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        weights = [tf1.Variable((rng.randn(16, 48) * 0.2).astype(np.float32)) for _ in range(3)]
        x = tf1.placeholder(tf.float32, [4, 64, 16])
        with tf.name_scope(scope):
            loss = scaled_attention_loss(weights, x)
        plan = msg.plan(loss, weights, checkpoints="memory")
        reference = tf1.gradients(loss, weights)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            metadata = tf1.RunMetadata()
            session.run(
                reference,
                {x: rng.randn(4, 64, 16).astype(np.float32)},
                options=tf1.RunOptions(output_partition_graphs=True),
                run_metadata=metadata,
            )
    assert len(_softmaxes_multiplied_ahead(metadata)) == ahead
    softmax = 4 * 64 * 64 * 4
    assert plan.plain_peak_bytes - plan.fallback_peak_bytes == ahead * softmax


@pytest.mark.parametrize("option", ["gate_gradients", "aggregation_tree", "not_colocated"])
@pytest.mark.parametrize("strategy", ["memory", "speed"])
def test_scaled_attention_keeps_its_gradient_products_in_order_in_a_session(strategy, option):
    """In a Session graph (and under TF1 behaviour, with reference variables), with each
    option: the rewrite's products by the scale read the product before them through an
    opaque pass, TensorFlow's optimizers leave no softmax multiplied by a constant, and the
    gradients are TensorFlow's."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        weights = [tf1.Variable((rng.randn(16, 48) * 0.2).astype(np.float32)) for _ in range(3)]
        x = tf1.placeholder(tf.float32, [4, 64, 16])
        loss = scaled_attention_loss(weights, x)
        reference = tf1.gradients(loss, weights, **OPTIONS[option])
        before = len(tf1.get_default_graph().get_operations())
        got = msg.gradients(loss, weights, checkpoints=strategy, **OPTIONS[option])
        scales = [
            op
            for op in tf1.get_default_graph().get_operations()[before:]
            if op.type == "Mul" and "_grad/" in op.name and _reads_the_scale(op)
        ]
        assert len(scales) >= len(weights)
        for op in scales:
            assert {t.op.type for t in op.inputs} == {"Const", "Slice"}, op.name
        feed = {x: rng.randn(4, 64, 16).astype(np.float32)}
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            want = session.run(reference, feed)
            metadata = tf1.RunMetadata()
            have = session.run(
                got,
                feed,
                options=tf1.RunOptions(output_partition_graphs=True),
                run_metadata=metadata,
            )
    assert_same_gradients(want, have)
    ahead = _softmaxes_multiplied_ahead(metadata)
    assert not ahead, ahead


def _softmaxes_multiplied_ahead(metadata) -> list[str]:
    """The Mul ops of a Session run's partition graphs (`metadata`) multiplying a softmax by
    a constant: products TensorFlow's optimizers moved into the forward pass."""
    nodes = [n for graph in metadata.partition_graphs for n in graph.node]
    types = {n.name: n.op for n in nodes}
    return [
        n.name
        for n in nodes
        if n.op == "Mul"
        and "Const" in (read := [types.get(i.lstrip("^").split(":")[0]) for i in n.input])
        and {"Softmax", "_MklSoftmax"} & set(read)
    ]


def _reads_the_scale(op: tf.Operation) -> bool:
    """Whether `op` reads the constant 16**-0.5 that `scaled_attention_loss` scales by."""
    return any(
        t.op.type == "Const" and t.shape.rank == 0 and np.isclose(tf.get_static_value(t), 0.25)
        for t in op.inputs
    )
