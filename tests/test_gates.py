"""Gates pass what a step reads on once backprop reaches it, through graph optimizers and XLA."""

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.rewriting import gates
from tests.helpers import assert_same_gradients
from tests.helpers import run_in_session as run

tf1 = tf.compat.v1


def test_gate_passes_tensors_on_placed_like_them_once_the_waits_exist():
    with tf.Graph().as_default():
        v = tf.Variable(tf.zeros([2]))
        with tf.device("/cpu:0"):
            x = tf1.placeholder(tf.float32, [None, 3])
        gradient = tf.constant([5.0, 6.0])
        weight_part = tf.constant([7.0])
        with tf.device("/device:CPU:1"), tf1.control_dependencies([v.op]), tf.name_scope("s"):
            (gated_x, gated_handle, gated_gradient), waits = gates.gate(
                [x, v.handle, gradient], gradient, [weight_part], scope="step/"
            )
        assert waits == [weight_part]
        assert gated_x.op.device == x.op.device
        assert gated_x.op.colocation_groups() == x.op.colocation_groups()
        assert gated_handle.op.colocation_groups() == v.handle.op.colocation_groups()
        assert gated_x.shape.as_list() == [None, 3]
        assert gated_x.op.name.startswith("step/")
        assert not gated_x.op.control_inputs
        # Each passed tensor depends by data on a zero that reads `after` and waits (control)
        # for the waits.
        zero = gated_x.op.inputs[1].op.inputs[1].op
        assert zero.name == "step/zero"
        upstream = set()
        stack = [zero]
        while stack:
            op = stack.pop()
            if op not in upstream:
                upstream.add(op)
                stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
        assert {gradient.op, weight_part.op} <= upstream
        read = tf.raw_ops.ReadVariableOp(resource=gated_handle, dtype=tf.float32)
        assert read.shape.as_list() == [2]  # the handle's data (shape, dtype) came along
        value = np.arange(6, dtype=np.float32).reshape(2, 3)
        got_x, got_gradient = run([gated_x, gated_gradient], {x: value})
        np.testing.assert_array_equal(got_x, value)
        np.testing.assert_array_equal(got_gradient, [5.0, 6.0])


def test_gate_survives_graph_optimizers_as_an_ordering():
    """Grappler drops identities and IdentityN outputs nobody reads; the gate must stay: the
    passed tensor is used after the wait (itself fetched, as gradients are) in the optimized
    graph too."""
    with tf.Graph().as_default() as graph:
        x = tf.Variable(tf.ones([4])).read_value()
        wait = tf.reduce_sum(tf.sin(x))
        (gated,), _ = gates.gate([x], wait, [], scope="step/")
        fetch = tf.tanh(gated)
        init = tf1.global_variables_initializer()
    metadata = tf1.RunMetadata()
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
    with tf1.Session(graph=graph) as session:
        session.run(init)
        session.run([fetch, wait], options=options, run_metadata=metadata)
    started = {
        node.node_name: node.all_start_micros
        for device in metadata.step_stats.dev_stats
        for node in device.node_stats
    }
    assert started["Sum"] <= started["Tanh"]
    assert any(name.startswith("step/") for name in started)


def _reads(op: tf.Operation, target: tf.Operation) -> bool:
    """Whether `op` reads, through data inputs only, what `target` makes."""
    stack, seen = [op], set()
    while stack:
        op = stack.pop()
        if op is target:
            return True
        if op not in seen:
            seen.add(op)
            stack.extend(t.op for t in op.inputs)
    return False


def test_gate_under_xla_passes_values_exactly_through_a_data_dependency():
    """XLA ignores control dependencies and expands optimization barriers early (NOTE [gates
    under XLA]): the gated tensors must read the waits as data, and equal their inputs bit for
    bit (signed zeros, infinities, NaNs, integers, booleans)."""
    seen = {}

    @tf.function(jit_compile=True)
    def step(x, n, b, g):
        (gx, gn, gb), (passed,) = gates.gate([x, n, b], g, [g], scope="step/")
        seen["passed"] = passed is g
        seen["reads"] = [_reads(t.op, g.op) for t in (gx, gn, gb)]
        seen["control"] = [op.name for t in (gx, gn, gb) for op in t.op.control_inputs]
        return gx, gn, gb

    x = tf.constant([-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5])
    n, b = tf.constant([-3, 7]), tf.constant([True, False])
    gx, gn, gb = step(x, n, b, tf.constant([np.nan, 4.0]))
    np.testing.assert_array_equal(np.signbit(gx.numpy()), np.signbit(x.numpy()))
    np.testing.assert_array_equal(gx.numpy(), x.numpy())
    np.testing.assert_array_equal(gn.numpy(), n.numpy())
    np.testing.assert_array_equal(gb.numpy(), b.numpy())
    assert seen == {"passed": True, "reads": [True, True, True], "control": []}


def _optimized_graph_nodes(graph: tf.Graph, fetches) -> list:
    """The nodes of `graph` as grappler left them, for a run of `fetches`."""
    metadata = tf1.RunMetadata()
    with tf1.Session(graph=graph) as session:
        session.run(tf1.global_variables_initializer())
        session.run(
            fetches,
            options=tf1.RunOptions(output_partition_graphs=True),
            run_metadata=metadata,
        )
    return [node for partition in metadata.partition_graphs for node in partition.node]


def test_graph_optimizers_see_the_static_shape_of_what_passes_a_gate():
    """Grappler knows the shape a gate passes on as Python does, so it treats what reads it
    as it treats the original readers: a convolution's input gradient takes its input's shape
    as a constant, where a shape unknown to grappler leaves a ShapeN run every step."""
    with tf.Graph().as_default() as graph:
        x = tf.Variable(tf.ones([2, 8, 8, 3])).read_value()
        w = tf.Variable(tf.ones([3, 3, 3, 4]))
        wait = tf.reduce_sum(tf.sin(x))
        (gated,), _ = gates.gate([x], wait, [], scope="step/")
        y = tf.nn.conv2d(gated, w, 1, "SAME")
        (input_gradient,) = tf.gradients(tf.reduce_sum(y * y), [gated])
    nodes = _optimized_graph_nodes(graph, input_gradient)
    assert any(node.name.startswith("step/") for node in nodes)  # the gate is there
    assert not [node.name for node in nodes if node.op == "ShapeN"]


def _upstream(op: tf.Operation) -> set[tf.Operation]:
    """The ops `op` waits for, through data and control inputs."""
    stack, seen = [op], set()
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


def test_a_step_its_gradients_reach_before_its_forward_pass_waits_for_that_pass():
    """Keras's loss is a mean: `div_no_nan(sum, count)`, whose gradient for the sum reads the
    count alone, so backprop reaches a step keeping the sum before the forward pass has made
    it. Without waiting for that pass, the executor recomputes the step's segment while the
    forward pass runs it, and holds both (a 2-block Keras encoder: 44 MiB, where 31.6 was
    predicted). The step waits for its boundary's forward op; a step reached through
    gradients that read the forward pass gets no such wait."""
    weights = [tf.Variable(tf.random.stateless_normal([8, 8], [i, 0]) * 0.3) for i in range(6)]
    x = tf.random.stateless_normal([4, 8], [9, 0])
    graphs = {}

    def loss_and_checkpoints():
        h, kept = x, []
        for w in weights:
            h = tf.tanh(h @ w)
            kept.append(h)
        total = tf.reduce_sum(h, name="total")
        return tf.math.divide_no_nan(total, tf.cast(tf.shape(h)[0], tf.float32)), [
            kept[1],
            total,
        ]

    @tf.function
    def checkpointed():
        loss, kept = loss_and_checkpoints()
        graphs["graph"] = loss.graph
        return msg.gradients(loss, weights, checkpoints=kept)

    @tf.function
    def plain():
        return tf.gradients(loss_and_checkpoints()[0], weights)

    assert_same_gradients(plain(), checkpointed())
    graph = graphs["graph"]
    steps = {
        op.name.split("/")[1]: op
        for op in graph.get_operations()
        if op.name.startswith("gradients/step_") and op.name.endswith("/zero")
    }
    assert len(steps) == 2
    total = graph.get_operation_by_name("total")
    kept_tanh = total.inputs[0].op.inputs[0].op.inputs[0].op.inputs[0].op.inputs[0].op
    assert kept_tanh.type == "Tanh"
    # step_0 is reached through the count alone; step_1 through tanh's gradients, which read
    # the forward pass up to `kept_tanh`
    assert any(total in op.control_inputs for op in _upstream(steps["step_0"]))
    assert not any(kept_tanh in op.control_inputs for op in _upstream(steps["step_1"]))
