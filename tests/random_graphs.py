"""Random forward graphs for property tests, as programs that hypothesis can shrink.

A program is a list of steps, each applying one kind of op to earlier values (its operands are
indices into the values made so far). Values keep shapes that broadcast against [BATCH, WIDTH],
and every op keeps magnitudes bounded, so gradients stay finite and comparable.

Besides elementwise ops, matmuls, concat/split and reductions, steps build function-call ops
(nested `tf.function` layers, stateless or reading variables, each called more than once, one
with a `tf.custom_gradient` inside) and the patterns oneDNN's graph rewrites fuse:
conv2d + bias_add + fused batch norm + relu (training and inference mode), matmul + bias_add +
relu, depthwise conv2d + bias_add + relu6. Convolutions see a [BATCH, WIDTH] value as one
[1, BATCH, WIDTH / 2, 2] image.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

BATCH, WIDTH = 3, 4
FULL = [BATCH, WIDTH]

UNARY = ("tanh", "sin", "sigmoid", "relu", "square_of_tanh", "identity", "negative")
BINARY = ("add", "sub", "mul_by_tanh", "maximum", "add_broadcast_row")
#: kind -> number of operands; every kind adds one value, except "split" which adds two.
ARITY = {
    **dict.fromkeys(UNARY, 1),
    **dict.fromkeys(BINARY, 2),
    "matmul": 1,
    "matmul_two": 2,
    "concat_split": 2,
    "split": 1,
    "mean_rows": 1,
    "mean_columns": 1,
    "stop_gradient": 1,
    "custom_gradient": 1,
    "matmul_bias_relu": 1,
    "conv_bn_relu": 1,
    "conv_bn_relu_inference": 1,
    "depthwise_bias_relu6": 1,
    "call_stateless": 1,
    "call_variable": 1,
    "call_nested": 2,
    "call_custom_gradient": 1,
}
#: Image shape of a value for convolutions, and their channels.
IMAGE, CHANNELS = [1, BATCH, WIDTH // 2, 2], 2
#: kind -> shapes of the variables each of its steps creates, in the order it reads them.
_KERNEL, _CHANNEL = [3, 3, CHANNELS, CHANNELS], [CHANNELS]
PARAMETERS = {
    "matmul": [[WIDTH, WIDTH]],
    "matmul_bias_relu": [[WIDTH, WIDTH], [WIDTH]],
    # kernel, bias, scale, offset (then mean and variance in inference mode)
    "conv_bn_relu": [_KERNEL, _CHANNEL, _CHANNEL, _CHANNEL],
    "conv_bn_relu_inference": [_KERNEL, *[_CHANNEL] * 5],
    "depthwise_bias_relu6": [[3, 3, CHANNELS, 1], _CHANNEL],
    "call_stateless": [[WIDTH, WIDTH]],
    "call_variable": [[WIDTH, WIDTH]],
}
STRATEGIES = ("memory", "balanced", "budget", "speed", "collection", "list")
#: Planned strategies never refuse: they may choose no checkpoints, and then gradients are plain.
PLANNED = ("memory", "balanced", "budget")


@dataclasses.dataclass(frozen=True)
class Program:
    """How to build a forward graph, its ys and xs, and which checkpoints to ask for."""

    inputs: int
    steps: tuple[tuple[str, tuple[int, ...]], ...]
    ys: tuple[int, ...]
    extra_xs: tuple[int, ...]
    weights_as_xs: bool
    strategy: str
    budget: float
    checkpoints: tuple[int, ...]
    grad_ys: bool


@st.composite
def programs(draw, max_steps: int = 24) -> Program:
    """Mostly chains with joins: operands are usually among the last few values, sometimes any
    earlier one (a residual or a branch join); ys always include the last value."""
    inputs = draw(st.integers(1, 3))
    count = inputs
    steps = []
    for _ in range(draw(st.integers(3, max_steps))):
        kind = draw(st.sampled_from(sorted(ARITY)))
        operands = tuple(draw(_operand(count)) for _ in range(ARITY[kind]))
        steps.append((kind, operands))
        count += 2 if kind == "split" else 1
    values = st.integers(0, count - 1)
    computed = st.integers(inputs, count - 1)
    ys = (count - 1, *draw(st.lists(values, max_size=2)))
    return Program(
        inputs=inputs,
        steps=tuple(steps),
        ys=ys,
        extra_xs=tuple(draw(st.lists(values, max_size=2))),
        weights_as_xs=draw(st.booleans()),
        strategy=draw(st.sampled_from(STRATEGIES)),
        budget=draw(st.sampled_from([0.05, 0.2, 0.5, 0.9, 0.99])),
        checkpoints=tuple(draw(st.lists(st.one_of(computed, values), max_size=8))),
        grad_ys=draw(st.booleans()),
    )


def _operand(count: int) -> st.SearchStrategy[int]:
    recent = st.integers(max(0, count - 3), count - 1)
    return st.one_of(recent, recent, st.integers(0, count - 1))


@dataclasses.dataclass
class Variables:
    """The program's variables and function layers: created once, outside any tf.function
    that builds it. `weights` holds every step's parameters in program order, then `gain`,
    the variable the function layers read without being given it."""

    inputs: list[tf.Variable]
    weights: list[tf.Variable]
    functions: Functions

    @classmethod
    def create(cls, program: Program) -> Variables:
        rng = np.random.RandomState(len(program.steps))
        inputs = [
            tf.Variable(rng.uniform(-1, 1, FULL).astype(np.float32), name=f"input{i}")
            for i in range(program.inputs)
        ]
        weights = [
            tf.Variable(_initial(rng, kind, i, shape), name=f"{kind}{step}_{i}")
            for step, (kind, _) in enumerate(program.steps)
            for i, shape in enumerate(PARAMETERS.get(kind, []))
        ]
        gain = tf.Variable(rng.uniform(0.5, 1.5, [WIDTH]).astype(np.float32), name="gain")
        if any(kind == "call_variable" for kind, _ in program.steps):
            weights.append(gain)
        return cls(inputs, weights, Functions(gain))


def _initial(rng: np.random.RandomState, kind: str, index: int, shape) -> np.ndarray:
    """Weights in [-0.5, 0.5]; batch-norm scales and variances (parameters 2 and 5 of a conv
    step) in [0.5, 1.5]."""
    positive = kind.startswith("conv_bn") and index in (2, 5)
    low, high = (0.5, 1.5) if positive else (-0.5, 0.5)
    return rng.uniform(low, high, shape).astype(np.float32)


class Functions:
    """The program's function layers, each one `tf.function` (so one function in the graph,
    called by a call op at every use).

    `dense` is stateless: its weight comes in as a tensor. `scaled_dense` reads the variable
    it is given and `gain`, which it captures: its call ops are stateful. `outer` calls
    `inner` twice (a call op inside a called function). `custom` has a `tf.custom_gradient`
    inside whose gradient is deliberately not tanh's, so taking any other route through it
    shows."""

    def __init__(self, gain: tf.Variable) -> None:
        @tf.function
        def dense(h, w):
            return tf.tanh(tf.matmul(h, w))

        @tf.function
        def scaled_dense(h, w):
            return tf.tanh(tf.matmul(h, w) * gain)

        @tf.function
        def inner(h):
            return tf.sin(h) + 0.5 * h

        @tf.function
        def outer(a, b):
            return inner(a) * tf.tanh(inner(b))

        @tf.function
        def custom(h):
            return 0.5 * odd_tanh(h) + tf.sigmoid(h)

        self.dense, self.scaled_dense, self.outer, self.custom = dense, scaled_dense, outer, custom


@tf.custom_gradient
def odd_tanh(x):
    """tanh, whose gradient is 0.5 * tanh' + 0.1 instead of tanh'."""
    y = tf.tanh(x)

    def grad(dy):
        return dy * (0.5 * (1.0 - y * y) + 0.1)

    return y, grad


@dataclasses.dataclass
class Built:
    ys: list[tf.Tensor]
    xs: list
    grad_ys: list[tf.Tensor] | None
    values: list[tf.Tensor]


def build(program: Program, variables: Variables) -> Built:
    """Build `program` in the default graph (or the tf.function being traced)."""
    weights = iter(variables.weights)
    values = [v.read_value() for v in variables.inputs]
    for kind, operands in program.steps:
        parameters = [next(weights) for _ in PARAMETERS.get(kind, [])]
        args = [values[i] for i in operands]
        values.extend(_apply(kind, args, parameters, variables.functions))
    ys = [values[i] for i in program.ys]
    grad_ys = None
    if program.grad_ys:
        rng = np.random.RandomState(len(ys))
        grad_ys = [
            tf.constant(rng.uniform(-1, 1, y.shape.as_list()).astype(np.float32)) for y in ys
        ]
    xs = [
        *variables.inputs,
        *(variables.weights if program.weights_as_xs else []),
        *(values[i] for i in program.extra_xs),
    ]
    return Built(ys, xs, grad_ys, values)


def _full(t: tf.Tensor) -> tf.Tensor:
    return t if t.shape.as_list() == FULL else tf.broadcast_to(t, FULL)


def _image(t: tf.Tensor) -> tf.Tensor:
    return tf.reshape(_full(t), IMAGE)


def _apply(kind: str, args: list[tf.Tensor], weights: list, functions: Functions):
    a = args[0]
    if kind == "tanh":
        return [tf.tanh(a)]
    if kind == "sin":
        return [tf.sin(a)]
    if kind == "sigmoid":
        return [tf.sigmoid(a)]
    if kind == "relu":
        return [tf.nn.relu(a)]
    if kind == "square_of_tanh":
        return [tf.square(tf.tanh(a))]
    if kind == "identity":
        return [tf.identity(a)]
    if kind == "negative":
        return [-a]
    if kind == "stop_gradient":
        return [tf.stop_gradient(a)]
    if kind == "add":
        return [a + args[1]]
    if kind == "sub":
        return [a - args[1]]
    if kind == "mul_by_tanh":
        return [a * tf.tanh(args[1])]
    if kind == "maximum":
        # Not max(a, b) itself: TensorFlow 2.21's grappler rewrites max(x, x + x) into
        # LeakyRelu(x, alpha=2), which is wrong for alpha > 1, in plain TensorFlow too.
        return [tf.maximum(a, tf.tanh(args[1]))]
    if kind == "add_broadcast_row":
        return [a + tf.reduce_mean(args[1], axis=0, keepdims=True)]
    if kind == "matmul":
        return [tf.matmul(_full(a), weights[0])]
    if kind in FUSABLE:
        return [FUSABLE[kind](a, *weights)]
    if kind == "custom_gradient":
        return [odd_tanh(a)]
    if kind == "call_stateless":  # the weight read outside: a stateless call op
        w = tf.convert_to_tensor(weights[0])
        return [functions.dense(functions.dense(_full(a), w), w)]
    if kind == "call_variable":  # the variable read inside: stateful call ops
        return [functions.scaled_dense(functions.scaled_dense(_full(a), weights[0]), weights[0])]
    if kind == "call_nested":
        return [functions.outer(_full(a), _full(args[1]))]
    if kind == "call_custom_gradient":
        return [functions.custom(_full(a))]
    if kind == "matmul_two":
        return [tf.matmul(_full(a), tf.transpose(_full(args[1]))) @ tf.ones([BATCH, WIDTH]) / 4]
    if kind == "concat_split":
        both = tf.concat([_full(a), _full(args[1])], axis=1)
        left, _ = tf.split(tf.tanh(both), 2, axis=1)
        return [left]
    if kind == "split":
        return [tf.concat([half, half], axis=1) for half in tf.split(_full(a), 2, axis=1)]
    if kind == "mean_rows":
        return [tf.reduce_mean(a, axis=1, keepdims=True)]
    if kind == "mean_columns":
        return [tf.reduce_mean(a, axis=0, keepdims=True)]
    raise ValueError(kind)


def _matmul_bias_relu(a, w, b):
    return tf.nn.relu(tf.nn.bias_add(tf.matmul(_full(a), w), b))


def _conv_bn_relu(a, kernel, bias, scale, offset, mean=None, variance=None):
    """Inference mode (mean and variance given) is the pattern fused into one convolution;
    a large epsilon keeps the normalization of 6 values per channel bounded."""
    h = tf.nn.bias_add(tf.nn.conv2d(_image(a), kernel, strides=1, padding="SAME"), bias)
    h, _, _ = tf.compat.v1.nn.fused_batch_norm(
        h, scale, offset, mean, variance, epsilon=0.1, is_training=mean is None
    )
    return tf.reshape(tf.nn.relu(h), FULL)


def _depthwise_bias_relu6(a, kernel, bias):
    h = tf.nn.depthwise_conv2d(_image(a), kernel, strides=[1, 1, 1, 1], padding="SAME")
    return tf.reshape(tf.nn.relu6(tf.nn.bias_add(h, bias)), FULL)


FUSABLE = {
    "matmul_bias_relu": _matmul_bias_relu,
    "conv_bn_relu": _conv_bn_relu,
    "conv_bn_relu_inference": _conv_bn_relu,
    "depthwise_bias_relu6": _depthwise_bias_relu6,
}
