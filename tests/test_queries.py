"""Graph walks, topological order and sizes."""

import pytest
import tensorflow as tf

from memory_saving_gradients._src.analysis import gradient_uses, kernels, queries
from memory_saving_gradients._src.analysis.view import ForwardView

tf1 = tf.compat.v1


def diamond() -> dict[str, tf.Tensor]:
    """x -> a -> (b, c) -> d, with a control edge from e (not followed by walks), by name."""
    x = tf1.placeholder(tf.float32, [4, None], name="x")
    a = tf.tanh(x, name="a")
    b = tf.sin(a, name="b")
    c = tf.cos(a, name="c")
    e = tf.exp(x, name="e")
    with tf1.control_dependencies([e]):
        d = tf.add(b, c, name="d")
    return {t.op.name: t for t in (x, a, b, c, d, e)}


def names(ops):
    return sorted(op.name for op in ops)


def test_backward_ops_follow_data_inputs_only():
    with tf.Graph().as_default():
        t = diamond()
        assert names(queries.backward_ops([t["d"].op])) == ["a", "b", "c", "d", "x"]


def test_backward_ops_within_and_stop_at():
    with tf.Graph().as_default():
        t = diamond()
        within = {t[name].op for name in "abcd"}
        assert names(queries.backward_ops([t["d"].op], within=within)) == ["a", "b", "c", "d"]
        stopped = queries.backward_ops([t["d"].op], stop_at=lambda x: x.ref() == t["b"].ref())
        assert names(stopped) == ["a", "c", "d", "x"]


def test_forward_ops_start_at_the_readers_of_the_seeds():
    with tf.Graph().as_default():
        t = diamond()
        assert names(queries.forward_ops([t["a"]])) == ["b", "c", "d"]
        within = {t[name].op for name in "abd"}
        assert names(queries.forward_ops([t["x"]], within=within)) == ["a", "b", "d"]


def test_topological_order_respects_inputs_then_creation_order():
    with tf.Graph().as_default():
        t = diamond()
        ops = [t[name].op for name in "dceba"]
        assert [op.name for op in queries.topological_order(ops)] == ["a", "b", "c", "e", "d"]
        # An input rerouted to a younger op must still come first.
        late = tf.identity(t["x"], name="late")
        t["a"].op._update_input(0, late)
        order = queries.topological_order([t["a"].op, late.op, t["b"].op])
        assert [op.name for op in order] == ["late", "a", "b"]
        assert queries.topological_order([]) == []


def test_sizes_count_unknown_dimensions_as_64():
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [4, None])
        assert kernels.num_elements(x) == 4 * kernels.UNKNOWN_DIM_SIZE
        assert kernels.tensor_bytes(tf.cast(x, tf.float16)) == 2 * 4 * kernels.UNKNOWN_DIM_SIZE
        assert kernels.tensor_bytes(tf.zeros([10, 10], tf.float64)) == 800
        assert kernels.num_elements(tf1.placeholder(tf.float32)) == kernels.UNKNOWN_DIM_SIZE


@pytest.mark.parametrize("v2_shapes", [True, False], ids=["TensorShape V2", "V1 Dimension"])
def test_static_shapes_read_alike_with_v1_dimensions(v2_shapes):
    """Under `disable_v2_behavior()` a shape holds `Dimension` objects, which hash as no int
    does (the cost model's cache key raised "unhashable type: 'Dimension'")."""
    if not v2_shapes:
        tf1.disable_v2_tensorshape()
    try:
        with tf.Graph().as_default():
            x = tf1.placeholder(tf.float32, [None, 3])
            assert isinstance(x.shape[1], int) == v2_shapes
            shape = queries.static_shape(x)
            assert shape == (None, 3) and all(d is None or type(d) is int for d in shape)
            hash(shape)
            assert queries.static_shape(tf1.placeholder(tf.float32)) is None
            assert kernels.tensor_bytes(x) == 4 * 3 * kernels.UNKNOWN_DIM_SIZE
            assert gradient_uses.gradient_use(tf.tanh(x).op).reads == (
                (frozenset(), frozenset({0})),
            )
    finally:
        tf1.enable_v2_tensorshape()


def test_segment_views_stop_at_their_boundaries():
    """Like tf.gradients, a view holds the ops from one x through another to the ys; a
    segment's view (`through_xs=False`) holds only those after its boundaries."""
    with tf.Graph().as_default():
        t = diamond()
        full = ForwardView.build([t["d"]], [t["x"], t["b"]])
        segment = ForwardView.build([t["d"]], [t["x"], t["b"]], through_xs=False)
    assert names(full.ops) == ["a", "b", "c", "d"]
    assert names(segment.ops) == ["a", "c", "d"]
