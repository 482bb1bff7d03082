"""Random forward graphs for property tests, as programs that hypothesis can shrink.

A program is a list of steps, each applying one kind of op to earlier values (its operands are
indices into the values made so far). Values keep shapes that broadcast against [BATCH, WIDTH],
and every op keeps magnitudes bounded, so gradients stay finite and comparable.
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
        budget=draw(st.sampled_from([0.05, 0.2, 0.5, 0.9, 1.5])),
        checkpoints=tuple(draw(st.lists(st.one_of(computed, values), max_size=8))),
        grad_ys=draw(st.booleans()),
    )


def _operand(count: int) -> st.SearchStrategy[int]:
    recent = st.integers(max(0, count - 3), count - 1)
    return st.one_of(recent, recent, st.integers(0, count - 1))


@dataclasses.dataclass
class Variables:
    """The program's variables: created once, outside any tf.function that builds it."""

    inputs: list[tf.Variable]
    weights: list[tf.Variable]

    @classmethod
    def create(cls, program: Program) -> Variables:
        rng = np.random.RandomState(len(program.steps))
        inputs = [
            tf.Variable(rng.uniform(-1, 1, FULL).astype(np.float32), name=f"input{i}")
            for i in range(program.inputs)
        ]
        matmuls = sum(kind == "matmul" for kind, _ in program.steps)
        weights = [
            tf.Variable(rng.uniform(-0.5, 0.5, [WIDTH, WIDTH]).astype(np.float32), name=f"w{i}")
            for i in range(matmuls)
        ]
        return cls(inputs, weights)


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
        values.extend(_apply(kind, [values[i] for i in operands], weights))
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


def _apply(kind: str, args: list[tf.Tensor], weights) -> list[tf.Tensor]:
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
        return [tf.matmul(_full(a), next(weights))]
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
