"""Graph walks, topological order and sizes."""

import tensorflow as tf

from memory_saving_gradients import graph
from memory_saving_gradients.view import ForwardView

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
        assert names(graph.backward_ops([t["d"].op])) == ["a", "b", "c", "d", "x"]


def test_backward_ops_within_and_stop_at():
    with tf.Graph().as_default():
        t = diamond()
        within = {t[name].op for name in "abcd"}
        assert names(graph.backward_ops([t["d"].op], within=within)) == ["a", "b", "c", "d"]
        stopped = graph.backward_ops([t["d"].op], stop_at=lambda x: x.ref() == t["b"].ref())
        assert names(stopped) == ["a", "c", "d", "x"]


def test_forward_ops_start_at_the_readers_of_the_seeds():
    with tf.Graph().as_default():
        t = diamond()
        assert names(graph.forward_ops([t["a"]])) == ["b", "c", "d"]
        within = {t[name].op for name in "abd"}
        assert names(graph.forward_ops([t["x"]], within=within)) == ["a", "b", "d"]


def test_topological_order_respects_inputs_then_creation_order():
    with tf.Graph().as_default():
        t = diamond()
        ops = [t[name].op for name in "dceba"]
        assert [op.name for op in graph.topological_order(ops)] == ["a", "b", "c", "e", "d"]
        # An input rerouted to a younger op must still come first.
        late = tf.identity(t["x"], name="late")
        t["a"].op._update_input(0, late)
        order = graph.topological_order([t["a"].op, late.op, t["b"].op])
        assert [op.name for op in order] == ["late", "a", "b"]
        assert graph.topological_order([]) == []


def test_sizes_count_unknown_dimensions_as_64():
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [4, None])
        assert graph.num_elements(x) == 4 * graph.UNKNOWN_DIM_SIZE
        assert graph.size_in_bytes(tf.cast(x, tf.float16)) == 2 * 4 * graph.UNKNOWN_DIM_SIZE
        assert graph.size_in_bytes(tf.zeros([10, 10], tf.float64)) == 800


def test_segment_views_stop_at_their_boundaries():
    """Like tf.gradients, a view holds the ops from one x through another to the ys; a
    segment's view (`through_xs=False`) holds only those after its boundaries."""
    with tf.Graph().as_default():
        t = diamond()
        full = ForwardView.build([t["d"]], [t["x"], t["b"]])
        segment = ForwardView.build([t["d"]], [t["x"], t["b"]], through_xs=False)
    assert names(full.ops) == ["a", "b", "c", "d"]
    assert names(segment.ops) == ["a", "c", "d"]
