"""Under XLA (`jit_compile=True`): checkpointed gradients keep their savings and equal plain
ones, through `msg.gradients`, the tape drop-in and Keras `fit`, with XLA left on.

XLA ignores control dependencies and merges identical computations; each step's recomputation
reads its inputs through a data dependency on the gradient arriving there (NOTE [gates under
XLA] in `memory_saving_gradients._src._tf`). Peaks are XLA CPU's, each against plain XLA
measured in the same process. The GPU tests at the end skip without a GPU.
"""

import json
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.models import graphs as models
from memory_saving_gradients.profiling import peak_memory
from tests.helpers import (
    assert_recomputes,
    assert_recomputes_where_it_pays,
    assert_same_gradients,
    run_python,
)

tf1 = tf.compat.v1
MiB = 2**20
LOGGER = "memory_saving_gradients"


def weights(shapes, seed: int = 0) -> list[tf.Variable]:
    rng = np.random.default_rng(seed)
    return [
        tf.Variable((rng.standard_normal(s) / np.sqrt(np.prod(s[:-1]))).astype("f4"))
        for s in shapes
    ]


def sgd_step(gradients, variables, x, device=None):
    """A `jit_compile=True` SGD step of `variables` by `gradients(x)`; returns the step and
    what was seen while tracing it."""
    seen = {}

    @tf.function(jit_compile=True)
    def step(x):
        with tf.device(device):
            grads = gradients(x)
            graph = tf1.get_default_graph()
            seen["xla"] = _tf.compiled_by_xla(graph)
            seen["recomputes"] = any("/recompute_" in op.name for op in graph.get_operations())
            for v, g in zip(variables, grads, strict=True):
                v.assign_sub(0.01 * g)

    def run():
        step(x)
        return [v.numpy() for v in variables[:1]]

    return run, seen


def tanh_chain(depth: int = 32, width: int = 256, batch: int = 1024, seed: int = 0):
    """The forward pass of a tanh(matmul) chain, its weights and its input (1 MiB layers)."""
    ws = weights([(width, width)] * depth, seed)

    def forward(x):
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        return tf.reduce_mean(tf.square(h))

    x = tf.constant(np.random.default_rng(9).standard_normal((batch, width)).astype("f4"))
    return forward, ws, x


def function_gradients(forward, variables, checkpoints, planned=None):
    """Gradients of `forward(x)` by `tf.gradients` (checkpoints "plain") or `msg.gradients`;
    the plan's predicted peak goes to `planned["MiB"]` where `planned` is given."""

    def gradients(x):
        if checkpoints == "plain":
            return tf.gradients(forward(x), variables)
        loss = forward(x)
        plan = msg.plan(loss, variables, checkpoints=checkpoints)
        if planned is not None:
            planned["MiB"] = plan.peak_bytes / MiB
        return msg.gradients(loss, variables, checkpoints=plan)

    return gradients


def tape_gradients(forward, variables, checkpoints):
    """Gradients of `forward(x)` by `tf.GradientTape` (checkpoints "plain") or the drop-in."""

    def gradients(x):
        plain = checkpoints == "plain"
        with tf.GradientTape() if plain else msg.GradientTape(checkpoints=checkpoints) as tape:
            loss = forward(x)
        return tape.gradient(loss, variables)

    return gradients


def peak_mib(run) -> float:
    """`peak_memory` of `run` in MiB, free of allocator rounding: TensorFlow's CPU allocator
    counts a block it does not split whole (a 67 MiB request served from a fresh 128 MiB
    region reads 128 MiB), so a free block far larger than any step here is made first, from
    which each request is cut to its size."""
    grow = tf.zeros([256 * MiB // 4])
    del grow
    return peak_memory(run) / MiB


def peaks(make_step, methods) -> dict[str, float]:
    """Peak MiB of a fresh step for each method (`make_step(method)` gives step and seen)."""
    found = {}
    for name in methods:
        run, seen = make_step(name)
        found[name] = peak_mib(run)
        assert seen["xla"], name
        assert seen["recomputes"] == (name != "plain"), name
    return found


def chain_peaks(gradients_of: str) -> dict:
    """Peaks of a jit-compiled SGD step on a tanh chain, plain and 'memory', with gradients by
    `function_gradients` or `tape_gradients`, and the library's warnings meanwhile. Run in a
    fresh interpreter (`fresh_chain_peaks`): after hundreds of tests the CPU allocator holds
    freed blocks of every size, and a step served from them reads larger peaks."""
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(LOGGER).addHandler(handler)
    planned = {}

    def make(method):
        forward, ws, x = tanh_chain(seed=0 if gradients_of == "function" else 1)
        if gradients_of == "function":
            return sgd_step(function_gradients(forward, ws, method, planned), ws, x)
        return sgd_step(tape_gradients(forward, ws, method), ws, x)

    return {**peaks(make, ["plain", "memory"]), "warnings": warnings, "planned": planned}


def fresh_chain_peaks(gradients_of: str) -> dict:
    code = "import json; from tests.test_xla import chain_peaks; "
    code += f"print(json.dumps(chain_peaks({gradients_of!r})))"
    return json.loads(run_python("-c", code).strip().splitlines()[-1])


def test_chain_keeps_its_savings_under_xla():
    found = fresh_chain_peaks("function")
    # Measured on TensorFlow 2.21: plain 33.25 MiB, 'memory' 10.75 MiB (0.32).
    assert found["memory"] <= 0.4 * found["plain"], found
    # The plan counts the copies XLA makes of what each step reads through its gate before
    # a matmul (predicted 11.0 MiB; 7.25, nested four levels deep, without them).
    assert found["planned"]["MiB"] == pytest.approx(found["memory"], rel=0.2), found


def test_tape_drop_in_keeps_its_savings_under_xla():
    found = fresh_chain_peaks("tape")
    assert not found["warnings"], found["warnings"]
    # Measured on TensorFlow 2.21: plain 33.25 MiB, 'memory' 10.75 MiB (0.32).
    assert found["memory"] <= 0.4 * found["plain"], found


def test_tape_drop_in_gradients_equal_plain_under_xla(caplog):
    model = models.residual_chain(depth=8)

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as reference, msg.GradientTape(checkpoints="memory") as tape:
            (loss,), _ = model.forward(x)
        got = tape.gradient(loss, model.variables)
        assert_recomputes(tf1.get_default_graph())
        return reference.gradient(loss, model.variables), got

    with caplog.at_level("WARNING", logger=LOGGER):
        reference, got = step(tf.constant(model.x))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert_same_gradients([g.numpy() for g in reference], [g.numpy() for g in got])


def residual_cnn(blocks: int = 16, channels: int = 16, size: int = 32, batch: int = 16):
    """conv, ReLU, conv, add, ReLU blocks (1 MiB activations): the skip path has no conv."""
    kernels = weights([(3, 3, channels, channels)] * (2 * blocks), seed=2)

    def forward(x):
        h = x
        for first, second in zip(kernels[::2], kernels[1::2], strict=True):
            r = tf.nn.relu(tf.nn.conv2d(h, first, 1, "SAME"))
            h = tf.nn.relu(h + tf.nn.conv2d(r, second, 1, "SAME"))
        return tf.reduce_mean(tf.square(h))

    rng = np.random.default_rng(3)
    x = tf.constant(rng.standard_normal((batch, size, size, channels)).astype("f4"))
    return forward, kernels, x


def residual_cnn_peaks() -> dict:
    """Peaks of a jit-compiled SGD step on the residual CNN, plain and 'memory'. Run in a
    fresh interpreter, as `chain_peaks`: in a suite's worker 'memory' once read 48 MiB."""

    def make(method):
        forward, kernels, x = residual_cnn()
        return sgd_step(function_gradients(forward, kernels, method), kernels, x)

    return peaks(make, ["plain", "memory"])


def test_residual_cnn_keeps_its_savings_under_xla():
    code = "import json; from tests.test_xla import residual_cnn_peaks; "
    code += "print(json.dumps(residual_cnn_peaks()))"
    found = json.loads(run_python("-c", code).strip().splitlines()[-1])
    # Measured on TensorFlow 2.21 in a fresh interpreter: plain 66.3 MiB, 'memory' 30.1 MiB
    # (0.45).
    assert found["memory"] <= 0.5 * found["plain"], found


STRATEGIES = {
    "memory": "memory",
    "balanced": "balanced",
    "speed": "speed",
    "list": "list",
    "budget": msg.MemoryBudget(0.5),
}


@pytest.mark.parametrize("model_fn", [models.residual_chain, models.conv_batchnorm_relu])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradients_equal_plain_under_xla(model_fn, strategy):
    model = model_fn()

    @tf.function(jit_compile=True)
    def step(x):
        ys, kept = model.forward(x)
        checkpoints = kept if strategy == "list" else STRATEGIES[strategy]
        plan = msg.plan(ys, model.variables, checkpoints=checkpoints)
        got = msg.gradients(ys, model.variables, checkpoints=checkpoints)
        assert _tf.compiled_by_xla(tf1.get_default_graph())
        assert_recomputes_where_it_pays(plan)
        return tf.gradients(ys, model.variables), got

    reference, got = step(tf.constant(model.x))
    assert_same_gradients([g.numpy() for g in reference], [g.numpy() for g in got])


@pytest.mark.parametrize("model_fn", [models.residual_chain, models.conv_batchnorm_relu])
def test_concrete_functions_of_xla_steps_recompute_and_equal_plain(model_fn):
    """`get_concrete_function` of a `jit_compile=True` function traces its ops inside XLA's
    control-flow context, which is no TF1 frame: they are recomputed as in a traced call."""
    model = model_fn()

    @tf.function(jit_compile=True)
    def step(x):
        ys, _ = model.forward(x)
        got = msg.gradients(ys, model.variables, checkpoints="memory")
        assert_recomputes(tf1.get_default_graph())
        return tf.gradients(ys, model.variables), got

    x = tf.constant(model.x)
    reference, got = step.get_concrete_function(x)(x)
    assert_same_gradients([g.numpy() for g in reference], [g.numpy() for g in got])


@pytest.mark.parametrize("strategy", ["memory", "speed"])
def test_tensordot_of_an_unknown_batch_compiles_recomputed(strategy):
    """`tf.tensordot` (Keras's Dense on 3-d inputs) reshapes to a target computed from
    `tf.shape` of its input; a recomputed copy read that target through its gate, which XLA
    cannot evaluate at compile time ("must be a compile-time constant"), as Keras `fit`
    traces with the batch unknown."""
    variables = weights([(64, 64)] * 8)

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 32, 64])])
    def step(x):
        h = x
        for w in variables:
            h = tf.tanh(tf.tensordot(h, w, axes=1))
        loss = tf.reduce_sum(h * h)
        got = msg.gradients(loss, variables, checkpoints=strategy)
        assert_recomputes(tf1.get_default_graph())
        return tf.gradients(loss, variables), got

    x = tf.constant(np.random.default_rng(0).standard_normal((4, 32, 64)).astype("f4"))
    reference, got = step(x)
    assert_same_gradients([g.numpy() for g in reference], [g.numpy() for g in got])


def test_random_ops_are_not_recomputed_under_xla():
    """Dropout without a seed: a recomputed mask would change the gradients."""
    model = models.dropout_chain()

    @tf.function(jit_compile=True)
    def step(x):
        ys, kept = model.forward(x)
        got = msg.gradients(ys, model.variables, checkpoints=kept)
        graph = tf1.get_default_graph()
        assert_recomputes(graph)
        copied = [op.type for op in graph.get_operations() if "/recompute_" in op.name]
        assert not any(t.startswith("Random") for t in copied), copied
        return tf.gradients(ys, model.variables), got

    reference, got = step(tf.constant(model.x))
    assert_same_gradients([g.numpy() for g in reference], [g.numpy() for g in got])


def dense_tanh_model(depth: int, width: int) -> keras.Model:
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
        + [keras.layers.Dense(1)]
    )


def keras_xla_fit_report() -> dict:
    """Plain and 'memory' Keras `fit` of a tanh Dense stack compiled by XLA: whether each
    trace of the enabled step was compiled (by its graph's name), the largest difference of
    their weights after `fit`, and each one's `train_on_batch` peak in MiB."""
    depth, width, batch = 24, 256, 2048
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2 * batch, width)).astype("f4")
    y = rng.standard_normal((2 * batch, 1)).astype("f4")
    trained, found, compiled_by_xla = {}, {}, []
    for name in ("plain", "memory"):
        keras.utils.set_random_seed(0)
        model = dense_tanh_model(depth, width)
        if name != "plain":
            msg.keras.enable(model, checkpoints=name)
            step = model.train_step

            def train_step(data, step=step):
                graph = tf1.get_default_graph()
                compiled_by_xla.append((graph.name, _tf.compiled_by_xla(graph)))
                outputs = step(data)
                assert_recomputes(graph)
                return outputs

            model.train_step = train_step
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=True)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        assert model.jit_compile
        trained[name] = model.get_weights()
        found[name] = peak_mib(lambda m=model: m.train_on_batch(x[:batch], y[:batch]))
    difference = max(
        float(np.abs(have - want).max() / max(np.abs(want).max(), 1e-6))
        for want, have in zip(trained["plain"], trained["memory"], strict=True)
    )
    return {"compiled_by_xla": compiled_by_xla, "difference": difference, **found}


def test_keras_fit_stays_compiled_by_xla_and_keeps_its_savings():
    """In a fresh interpreter: in the suite's, after hundreds of tests the allocator's freed
    blocks served the enabled step, which read 29.5 MiB against plain's 54.3 once."""
    code = "import json; from tests.test_xla import keras_xla_fit_report; "
    code += "print(json.dumps(keras_xla_fit_report()))"
    found = json.loads(run_python("-c", code).strip().splitlines()[-1])
    # Each trace of the step, named by its graph, so a failure says which one left XLA.
    compiled = found["compiled_by_xla"]
    assert compiled and all(on for _, on in compiled), compiled
    assert found["difference"] <= 1e-5, found
    # Measured on TensorFlow 2.21 in a fresh interpreter: plain 66.0 MiB, 'memory' 17.8 (0.27).
    assert found["memory"] <= 0.5 * found["plain"], found


needs_gpu = pytest.mark.skipif(
    not tf.config.list_physical_devices("GPU"), reason="needs a GPU visible to TensorFlow"
)


@needs_gpu
def test_gpu_gradients_equal_plain_under_xla():
    with tf.device("/GPU:0"):
        model = models.residual_chain(depth=12, width=64)

    @tf.function(jit_compile=True)
    def step(x):
        with tf.device("/GPU:0"):
            ys, _ = model.forward(x)
            got = msg.gradients(ys, model.variables, checkpoints="memory")
            assert_recomputes(tf1.get_default_graph())
            return tf.gradients(ys, model.variables), got

    reference, got = step(tf.constant(model.x))
    assert_same_gradients([g.numpy() for g in reference], [g.numpy() for g in got], rtol=1e-4)


@needs_gpu
def test_gpu_chain_keeps_its_savings_under_xla():
    def make(method):
        with tf.device("/GPU:0"):
            forward, ws, x = tanh_chain(depth=24, width=1024, batch=2048)
        return sgd_step(function_gradients(forward, ws, method), ws, x, device="/GPU:0")

    found = {}
    for name in ("plain", "memory"):
        run, seen = make(name)
        found[name] = peak_memory(run, device="GPU:0") / MiB
        assert seen["xla"] and seen["recomputes"] == (name != "plain")
    assert found["memory"] <= 0.5 * found["plain"], found
