"""Each TensorFlow private API in `memory_saving_gradients._src._tf` still does what we rely on.

When a TensorFlow release changes one of them, the test named after it fails here first.
"""

import platform

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.training import optimizer as v1_optimizer

from memory_saving_gradients._src import _tf
from tests.helpers import ops_run_for, run_python
from tests.helpers import run_in_session as run

tf1 = tf.compat.v1


def test_copy_op_keeps_type_attributes_device_shapes_and_value():
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [None, 3])
        with tf.device("/cpu:0"):
            y = tf.nn.leaky_relu(x, alpha=0.3, name="act")
        with tf.device("/cpu:0"), tf1.colocate_with(x.op), tf1.control_dependencies([y.op]):
            copy = _tf.copy_op(y.op, [x], name="copies/act")
        assert copy.type == y.op.type
        assert copy.name == "copies/act"
        assert copy.get_attr("alpha") == pytest.approx(0.3)
        assert copy.device == y.op.device
        assert copy.control_inputs == []
        # In the original's colocation group (the caller's colocation scope is left).
        assert copy.colocation_groups() == [b"loc:@act"]
        with tf1.colocate_with(x.op):
            z = tf.nn.relu(x, name="z")
        colocated = _tf.copy_op(z.op, [x], name="copies/z")
        assert (
            colocated.colocation_groups()
            == z.op.colocation_groups()
            == [b"loc:@" + x.op.name.encode()]
        )
        assert copy.outputs[0].shape.as_list() == [None, 3]
        assert _tf.copy_op(y.op, [x], name="copies/act").name == "copies/act_1"
        value = np.array([[-1.0, 0.0, 2.0]], np.float32)
        original, copied = run([y, copy.outputs[0]], {x: value})
        np.testing.assert_array_equal(original, copied)
        assert graph.get_operation_by_name("copies/act") is copy


def test_copy_op_keeps_the_gradient_override_of_custom_gradients():
    with tf.Graph().as_default():
        x = tf.constant([1.0, 2.0])

        @tf.custom_gradient
        def times_two_with_gradient_seven(v):
            return 2 * v, lambda dy: 7 * dy

        y = times_two_with_gradient_seven(x)
        copy = _tf.copy_op(y.op, list(y.op.inputs), name="copy")
        gradient = tf1.gradients(copy.outputs[0], x)[0]
        np.testing.assert_array_equal(run(gradient), [7.0, 7.0])


def test_outside_caller_scopes_leaves_the_callers_scopes_and_keeps_xla_compilation():
    with tf.Graph().as_default() as graph:
        x = tf.constant(1.0, name="x")
        with (
            tf.name_scope("caller"),
            tf1.colocate_with(x.op),
            tf1.control_dependencies([x]),
            _tf.outside_caller_scopes(graph),
        ):
            free = tf.constant(2.0, name="free")
    assert free.op.name == "free"
    assert free.op.control_inputs == []
    assert free.op.colocation_groups() == [b"loc:@free"]
    seen = {}

    @tf.function(jit_compile=True)
    def compiled(v):
        with _tf.outside_caller_scopes(v.graph):
            seen["xla"] = _tf.compiled_by_xla(v.graph)
            return tf.sin(v)

    compiled(tf.constant(1.0))
    assert seen["xla"]


def test_differentiated_as_passes_a_value_on_and_differentiates_it_as_another_op():
    """The pass-through gives `value` and the gradient of `op` into `op`'s inputs; `op`
    (whose output nothing reads) never runs, which the value it would give shows."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [2, 3])
        w = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
        product = tf.matmul(x, w)
        stand_in = tf.ones([2, 4]) * 7.0  # not product: shows which value is passed on
        passed = _tf.differentiated_as(stand_in, [product.op], product.op.inputs)
        loss = tf.reduce_sum(tf.sin(passed))
        through = tf1.gradients(loss, [x, w])
        assert passed.shape.as_list() == [2, 4]
        assert not product.consumers()
        # d loss / d product is cos(7), carried on through the matmul's own gradient.
        reference = tf1.gradients(tf.reduce_sum(product * tf.cos(stand_in)), [x, w])
        value = np.ones((2, 3), np.float32)
        got_value, got, want = run([passed, through, reference], {x: value})
    np.testing.assert_array_equal(got_value, np.full((2, 4), 7.0, np.float32))
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6)


def test_differentiated_as_a_chain_reads_the_value_where_the_last_op_reads_its_output():
    """Passed on as a softmax of a transposed product, the saved probabilities' gradient goes
    through the softmax's gradient (reading the value passed on), the transpose's and the
    product's into the product's inputs: neither the softmax nor what it reads runs."""
    with tf.Graph().as_default():
        q = tf1.placeholder(tf.float32, [2, 3, 4])
        k = tf.constant(np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4))
        scores = tf.matmul(q, k, transpose_b=True)
        turned = tf.transpose(scores, [0, 2, 1])
        probabilities = tf.nn.softmax(turned)
        saved = tf.identity(probabilities)  # what the forward pass kept
        chain = [probabilities.op, turned.op, scores.op]
        passed = _tf.differentiated_as(saved, chain, [q, k, turned.op.inputs[1]], True)
        weights = tf.constant(np.linspace(0, 2, 18, dtype=np.float32).reshape(2, 3, 3))
        through = tf1.gradients(tf.reduce_sum(passed * weights), [q, k])
        assert [c.type for c in probabilities.consumers()] == ["Identity"]
        assert [c.type for c in turned.consumers()] == ["Softmax"]
        assert [c.type for c in scores.consumers()] == ["Transpose"]
        reference = tf1.gradients(tf.reduce_sum(probabilities * weights), [q, k])
        value = np.linspace(-2, 2, 24, dtype=np.float32).reshape(2, 3, 4)
        got, want = run([through, reference], {q: value})
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("halves_read", [2, 1], ids=["both-halves", "one-half"])
def test_differentiated_as_a_chain_through_a_split_gives_each_output_its_gradient(halves_read):
    """Passed on as a rotation (a split in halves, read as rotary embeddings read them, or
    one half of it alone), the gradient goes through the split's gradient with a part for
    each of its outputs, zeros where nothing reads one: neither the split nor what it reads
    runs."""
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3, 4])
        w = tf.constant(np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4))
        product = tf.matmul(x, w)
        first, second = tf.split(product, 2, axis=1)
        negated = -second
        turned = tf.concat([negated, first], axis=1) if halves_read == 2 else first * 3.0
        chain = [turned.op, *([negated.op] if halves_read == 2 else []), first.op, product.op]
        frontier = [t for op in chain for t in op.inputs if t.op not in chain]
        kept = tf1.placeholder(tf.float32, turned.shape)  # what the forward pass kept
        passed = _tf.differentiated_as(kept, chain, list(dict.fromkeys(frontier)))
        through = tf1.gradients(tf.reduce_sum(tf.sin(passed)), [x])
        assert first.op not in ops_run_for(through)
        reference = tf1.gradients(tf.reduce_sum(tf.sin(turned)), [x])
        value = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
        with tf1.Session() as session:
            forward = session.run(turned, {x: value})
            got = session.run(through, {x: value, kept: forward})
            want = session.run(reference, {x: value})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_copy_handle_data_lets_a_pass_through_of_a_handle_read_the_variable():
    with tf.Graph().as_default():
        v = tf.Variable([1.0, 2.0])
        passed = tf.raw_ops.Identity(input=v.handle)
        _tf.copy_handle_data(v.handle, passed)
        read = tf.raw_ops.ReadVariableOp(resource=passed, dtype=tf.float32)
        assert read.shape.as_list() == [2]
        np.testing.assert_array_equal(run(read), [1.0, 2.0])


def test_is_function_call():
    from tensorflow.python.framework import function

    @tf.function
    def body(v):
        return tf.sin(v)

    @function.Defun(tf.float32)
    def defun(v):
        return tf.cos(v)

    with tf.Graph().as_default():
        x = tf.constant(1.0)
        assert _tf.is_function_call(body(x).op)
        assert _tf.is_function_call(defun(x).op)
        assert not _tf.is_function_call(tf.tanh(x).op)


def test_boundaries_stop_backprop_where_stop_gradients_does_not_at_function_calls():
    """TensorFlow's gradient code differentiates a function-call op listed in stop_gradients
    all the same (NOTE [function calls in stop_gradients] in _tf.py); a boundary stops."""

    @tf.function
    def body(v):
        return tf.sin(v)

    with tf.Graph().as_default():
        x = tf.constant(1.0)
        called = body(x)
        y = 3.0 * called + x
        options = {
            "name": "g", "colocate_gradients_with_ops": True, "gate_gradients": False,
            "aggregation_method": None,
        }  # fmt: skip
        through = _tf.tensorflow_gradients(
            [y], [called, x], None, stop_gradients=[called], **options
        )
        stopped = _tf.tensorflow_gradients(
            [y], [called, x], None, stop_gradients=[], boundaries=[called], **options
        )
        values = run([*through, *stopped])
    np.testing.assert_allclose(values, [3.0, 1.0 + 3.0 * np.cos(1.0), 3.0, 1.0], rtol=1e-6)
    assert called.op._gradient_function is not None  # restored after the call


def test_is_differentiable():
    with tf.Graph().as_default():
        assert _tf.is_differentiable(tf.constant(1.0))
        assert _tf.is_differentiable(tf.constant(1.0, tf.complex64))
        assert _tf.is_differentiable(tf.Variable(1.0).handle)
        assert not _tf.is_differentiable(tf.constant(1))
        assert not _tf.is_differentiable(tf.constant("a"))


def test_add_control_inputs_skips_existing_ones():
    with tf.Graph().as_default():
        a, b = tf.constant(1.0), tf.constant(2.0)
        with tf1.control_dependencies([a.op]):
            c = tf.identity(b)
        _tf.add_control_inputs(c.op, [a.op, b.op])
        assert c.op.control_inputs == [a.op, b.op]


def test_replace_input_makes_an_op_read_another_tensor():
    with tf.Graph().as_default():
        x, y = tf.constant(2.0), tf.constant(5.0)
        z = tf.sin(x)
        _tf.replace_input(z.op, 0, y)
        assert z.op.inputs[0] is y
        with tf1.Session() as session:
            assert session.run(z) == pytest.approx(np.sin(5.0))


def test_creation_index_follows_creation_order():
    with tf.Graph().as_default() as graph:
        a = tf.constant(1.0)
        b = tf.tanh(a)
        c = tf.sin(b)
        ops = graph.get_operations()
    assert [_tf.creation_index(op) for op in ops] == sorted(_tf.creation_index(op) for op in ops)
    assert _tf.creation_index(a.op) < _tf.creation_index(b.op) < _tf.creation_index(c.op)


def test_is_stateful():
    with tf.Graph().as_default():
        assert _tf.is_stateful(tf.random.uniform([2]).op)
        handle = tf.Variable(1.0).handle
        assert _tf.is_stateful(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32).op)
        assert not _tf.is_stateful(tf.tanh(tf.constant(1.0)).op)


def test_in_v1_control_flow():
    tf1.disable_control_flow_v2()
    try:
        with tf.Graph().as_default():
            result = tf1.while_loop(lambda i: i < 3, lambda i: tf.tanh(i) + 1.0, [0.0])
            body_ops = [op for op in tf1.get_default_graph().get_operations() if "Tanh" in op.name]
            assert body_ops and all(_tf.in_v1_control_flow(op) for op in body_ops)
            assert not _tf.in_v1_control_flow(tf.identity(result).op)
    finally:
        tf1.enable_control_flow_v2()


def test_building_in_v1_control_flow():
    tf1.disable_control_flow_v2()
    try:
        with tf.Graph().as_default() as graph:
            inside = []

            def body(i):
                inside.append(_tf.building_in_v1_control_flow(graph))
                return i + 1.0

            tf1.while_loop(lambda i: i < 3, body, [0.0])
            assert inside == [True]
            assert not _tf.building_in_v1_control_flow(graph)
    finally:
        tf1.enable_control_flow_v2()


def test_the_context_of_xla_compilation_is_no_v1_control_flow():
    traced = []

    @tf.function(jit_compile=True)
    def compiled(x):
        y = tf.tanh(x)
        traced.append(y.op)
        return y

    compiled.get_concrete_function(tf.TensorSpec([2]))  # traced inside XLA's context
    assert traced[0]._get_control_flow_context() is not None
    assert not _tf.in_v1_control_flow(traced[0])


def test_tensorflow_gradients_is_tensorflows_own_even_while_patched(monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("the patched function must not be reached")

    for point in _tf.gradient_entry_points():
        monkeypatch.setattr(point.module, point.attribute, broken)
    with tf.Graph().as_default():
        x = tf.constant([1.0, 2.0])
        unused = tf.constant(3.0)
        y = tf.reduce_sum(x * x)
        gradients = _tf.tensorflow_gradients(
            [y], [x, unused], None, name="g", colocate_gradients_with_ops=True,
            gate_gradients=False, aggregation_method=None, stop_gradients=[],
        )  # fmt: skip
        assert gradients[1] is None
        np.testing.assert_array_equal(run(gradients[0]), [2.0, 4.0])


def test_zero_gradient_of_a_resource_handle_has_the_variable_shape():
    with tf.Graph().as_default():
        variable = tf.Variable(np.ones((2, 3), np.float32))
        np.testing.assert_array_equal(run(_tf.zero_gradient(variable.handle)), np.zeros((2, 3)))


def test_sum_gradients_adds_dense_and_concatenates_sparse():
    with tf.Graph().as_default():
        dense = _tf.sum_gradients([tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])])
        sparse = _tf.sum_gradients(
            [
                tf.IndexedSlices(tf.constant([[1.0]]), tf.constant([0]), tf.constant([3, 1])),
                tf.IndexedSlices(tf.constant([[2.0]]), tf.constant([2]), tf.constant([3, 1])),
            ]
        )
        assert isinstance(sparse, tf.IndexedSlices)
        dense_value, indices = run([dense, sparse.indices])
        np.testing.assert_array_equal(dense_value, [4.0, 6.0])
        np.testing.assert_array_equal(indices, [0, 2])


def test_sum_gradients_sums_on_each_device_first_as_tensorflow_does():
    with tf.Graph().as_default():
        here = [tf.constant([1.0]), tf.constant([2.0])]
        with tf.device("/cpu:1"):
            elsewhere = tf.constant([5.0])
        total = _tf.sum_gradients([*here, elsewhere])
        sums = [t.op for t in total.op.inputs]
        assert {op.colocation_groups()[0] for op in sums} == {
            here[0].op.colocation_groups()[0],
            elsewhere.op.colocation_groups()[0],
        }
        assert _tf.sum_gradients(here[:1]) is here[0]


def test_gradient_entry_points_hold_tensorflows_functions():
    for point in _tf.GRADIENT_ENTRY_POINTS:
        assert getattr(point.module, point.attribute) is point.original, point
    assert v1_optimizer.gradients is _tf.GRADIENT_ENTRY_POINTS[-1].module


def test_is_resource_variable_knows_tensorflow_keras_and_distributed_variables():
    import keras

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        distributed = tf.Variable(1.0)
    assert _tf.is_resource_variable(tf.Variable(1.0))
    assert _tf.is_resource_variable(keras.Variable(1.0))
    assert _tf.is_resource_variable(distributed)
    assert not _tf.is_resource_variable(tf.constant(1.0))
    assert not _tf.is_resource_variable(np.float32(1.0))


def test_compiled_by_xla_sees_jit_compile_only():
    seen = {}

    def record(jit_compile):
        @tf.function(jit_compile=jit_compile)
        def step(x):
            seen[jit_compile] = _tf.compiled_by_xla(tf1.get_default_graph())
            return x + 1.0

        step(tf.constant(1.0))

    for jit_compile in (None, False, True):
        record(jit_compile)
    with tf.Graph().as_default() as graph:
        seen["session"] = _tf.compiled_by_xla(graph)
    assert seen == {None: False, False: False, True: True, "session": False}


def test_gradient_aside_builds_the_registered_gradient_apart_and_names_what_it_reads():
    with tf.Graph().as_default() as graph:
        x = tf1.placeholder(tf.float32, [4, 3])
        w = tf1.placeholder(tf.float32, [3, 2])
        product = tf.matmul(x, w)
        before = len(graph.get_operations())
        aside = _tf.gradient_aside(product.op)
        assert len(graph.get_operations()) == before, "the user's graph is left as it was"
        assert aside.graph is not graph
        assert [g.shape.as_list() for g in aside.input_gradients] == [[4, 3], [3, 2]]
        (output_gradient,) = aside.output_gradients
        assert output_gradient.graph is aside.graph and output_gradient.shape == [4, 2]
        assert set(aside.read) == {id(x), id(w)}, "MatMul's gradient reads both inputs"
        tanh = tf.tanh(x)
        assert set(_tf.gradient_aside(tanh.op).read) == {id(tanh)}, "Tanh's reads its output"


def test_gradient_aside_refuses_ops_whose_gradients_rewrite_their_forward_op():
    @tf.function
    def layer(v):
        return tf.tanh(v)

    @tf.custom_gradient
    def clipped(v):
        return tf.identity(v), lambda dy: tf.clip_by_value(dy, -1.0, 1.0)

    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3])
        loop = tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v * 2.0), [0, x])
        branch = tf.cond(tf.reduce_sum(x) > 0, lambda: x * 2.0, lambda: x)
        ops = [layer(x).op, _control_flow_op(loop[1]), _control_flow_op(branch), clipped(x).op]
        assert {ops[1].type, ops[2].type} <= _tf.CONTROL_FLOW_TYPES
        for op in [*ops, tf.shape(x).op]:
            assert _tf.gradient_aside(op) is None, op.type


def _control_flow_op(output: tf.Tensor) -> tf.Operation:
    """The If or While op behind an output of tf.cond or tf.while_loop (each passes its
    outputs on through an Identity)."""
    return output.op.inputs[0].op if output.op.type == "Identity" else output.op


def test_called_op_types_reads_bodies_and_their_callees_from_the_library():
    @tf.function
    def inner(v):
        return tf.nn.relu(v)

    @tf.function
    def outer(v):
        return inner(tf.matmul(v, v))

    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [3, 3])
        call = outer(x).op
        branch = _control_flow_op(
            tf.cond(tf.reduce_sum(x) > 0, lambda: tf.sigmoid(x), lambda: tf.tanh(x))
        )
        assert {"MatMul", "Relu"} <= _tf.called_op_types(call)
        assert {"Sigmoid", "Tanh"} <= _tf.called_op_types(branch)
        assert _tf.called_op_types(tf.tanh(x).op) == frozenset()


def test_read_profile_reads_allocations_and_kernels_the_profiler_wrote(tmp_path):
    weights = tf.Variable(tf.ones([256, 512]))

    @tf.function
    def step():
        return tf.reduce_sum(tf.tanh(tf.ones([512, 256]) @ weights, name="profiled_tanh"))

    step()
    tf.profiler.experimental.start(str(tmp_path))
    step()
    tf.profiler.experimental.stop()
    space = _tf.read_profile(str(tmp_path))
    names = {m.name for plane in space.planes for m in plane.event_metadata.values()}
    assert "MemoryAllocation" in names
    assert any(name.startswith("profiled_tanh:") for name in names), sorted(names)[:20]


def test_onednn_enabled_follows_tf_enable_onednn_opts():
    """On by default on x86, off in a process started with TF_ENABLE_ONEDNN_OPTS=0."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert _tf.onednn_enabled() is True
    code = "from memory_saving_gradients._src import _tf; print(_tf.onednn_enabled())"
    output = run_python("-c", code, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert output.strip().splitlines()[-1] == "False"
