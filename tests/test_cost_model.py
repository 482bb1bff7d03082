"""The cost model against TensorFlow: predicted activation peaks within 20% of the measured
ones on small instances of a residual CNN, a DenseNet-style net, a U-Net and a transformer,
plain and 'memory', and exactly (1 MB units) on chains.

`msg.plan` predicts the peak of a step (`Plan.peak_bytes`; a plan keeping nothing gives
plain `tf.gradients`'s). The step is then measured as test_memory measures it: in a fresh
graph, in Sessions with one inter-op thread of their own, a warm-up step, then the
allocator's peak above what was resident before the step, fetching the gradients (which the
model counts alive to the end of the step). The smallest of three fresh Sessions is taken:
the executor times ops to choose which of the ready ones wait, so one Session may hold more
at once than another. Every step is measured in one fresh interpreter that first makes a
free block larger than any step: after hundreds of tests the CPU allocator holds freed blocks
of every size, and a request served whole from a block up to twice its size reads larger
(test_xla's `peak_mib`). Tensors are 256 KiB or more: the CPU allocator does not count
smaller ones. One step applies its gradients by SGD instead, as they are made: the model
counts no temporary for the updates, which run in place. A float16 chain of matmuls checks the
float32 copies TensorFlow's CPU MatMul makes of half-precision operands and results where
oneDNN does not compute in float16 (`kernels.working_bytes`), closer than the families: without
them its 'memory' step was under-predicted by 29%; and that none are counted on CPUs where it
does.
"""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.analysis import costs, gradient_uses, kernels
from memory_saving_gradients._src.models import command as models
from memory_saving_gradients.profiling import peak_memory
from tests.helpers import run_python
from tests.test_memory import SLACK_MB, chain

tf1 = tf.compat.v1
#: Issue 10: predicted peaks within this fraction of the measured ones.
TOLERANCE = 0.20
#: Bytes of test_memory's 1 MB tensors.
MB = 1e6
SESSIONS = 3


def _nested(*levels: list[int]):
    """Checkpoints `levels[0]` of a chain's nodes, nested `levels[1:]`: a fixed plan, whatever
    the strategies choose."""
    return lambda nodes: (
        lambda view: msg.Plan(view, [[nodes[i] for i in level] for level in levels], "nested")
    )


#: Chains of n tanh ops on a 1 MB variable (test_memory's), and what they keep.
CHAINS = {
    "plain 10": (10, False, None),
    "every 5 of 20": (20, False, lambda nodes: nodes[5:20:5]),
    "'memory' 30": (30, False, "memory"),
    "residual 'memory' 16": (16, True, "memory"),
    # Inner steps read the boundary before their segment until the last of them is done.
    "residual nested 16": (16, True, _nested([6, 11, 15], [3, 9, 14], [13])),
    "nested 30": (30, False, _nested([11, 21], [6, 16, 26], [4, 14, 24])),
}
#: Models of the command (`_src/models/command.py`) at sizes whose tensors are 256 KiB or more.
FAMILIES = {
    "resnet": (3, models.Shape(batch=8, width=16, size=32)),
    "densenet": (4, models.Shape(batch=8, width=12, size=32)),
    "unet": (3, models.Shape(batch=4, width=16, size=64)),
    "transformer": (2, models.Shape(batch=4, width=128, size=128)),
}
METHODS = (None, "memory")


def _keep_nothing(view: msg.ForwardView) -> msg.Plan:
    """A plan keeping no checkpoints: its predicted peak is plain backprop's."""
    return msg.Plan(view, [], "plain")


def _predicted_and_measured(build) -> tuple[float, float]:
    """(predicted, smallest measured) bytes of the step `build()` makes in a fresh graph,
    returning (plan, what to fetch)."""
    graph = tf.Graph()
    with graph.as_default():
        plan, fetch = build()
        init = tf1.global_variables_initializer()
    config = tf1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
    measured = []
    for _ in range(SESSIONS):
        with tf1.Session(graph=graph, config=config) as session:
            session.run(init)
            measured.append(peak_memory(lambda: session.run(fetch)))
    return plan.peak_bytes, min(measured)


def _step(ys, xs, checkpoints):
    """The plan for `checkpoints` (None: plain) and the gradients it computes, which the step
    fetches: they are held to its end."""
    if checkpoints is None:
        plain = msg.plan(ys, xs, checkpoints=_keep_nothing, gradients_held=True)
        return plain, tf.gradients(ys, xs)
    plan = msg.plan(ys, xs, checkpoints=checkpoints, gradients_held=True)
    return plan, msg.gradients(ys, xs, checkpoints=plan)


def chain_peaks(name: str) -> tuple[float, float]:
    n, residual, checkpoints = CHAINS[name]

    def build():
        start, nodes = chain(n, residual)
        chosen = checkpoints(nodes) if callable(checkpoints) else checkpoints
        return _step(tf.reduce_sum(nodes[-1]), start, chosen)

    return _predicted_and_measured(build)


def family_peaks(name: str, checkpoints: str | None) -> tuple[float, float]:
    depth, shape = FAMILIES[name]

    def build():
        model = models.build(name, depth, shape)
        plan, gradients = _step(model.loss(models.unwrapped), model.variables, checkpoints)
        return plan, [g for g in gradients if g is not None]

    return _predicted_and_measured(build)


def applied_peaks() -> tuple[float, float]:
    """(predicted, measured) bytes of an SGD step on the command's chain (4 MiB weights, 2 MiB
    activations) keeping every fourth layer's output, each gradient applied as it is made."""

    def build():
        model = models.build("chain", 16, models.Shape(batch=512, width=1024, size=0))
        loss = model.loss(models.unwrapped)
        tanhs = [op.outputs[0] for op in loss.graph.get_operations() if op.type == "Tanh"]
        plan = msg.plan(loss, model.variables, checkpoints=tanhs[3:-1:4])
        gradients = msg.gradients(loss, model.variables, checkpoints=plan)
        updates = [
            v.assign_sub(0.01 * g, read_value=False)
            for v, g in zip(model.variables, gradients, strict=True)
        ]
        return plan, updates

    return _predicted_and_measured(build)


#: A float16 chain's predicted peaks within these fractions of the measured ones. Where its
#: matmuls compute in float32, plain is predicted 53.5 MiB and measured 54; 'memory' 34.0
#: against 34.5-38.0 over clean runs (the allocator rounds some requests to a larger free
#: block); without the float32 copies they were 15% and 29-38% under. Where oneDNN computes
#: them in float16 (AVX512_FP16), plain is predicted 46.0 and measured 46.3, 'memory' 25.0
#: against 28.3; counting the copies there, 56.1 against 48.5 and 35.7 against 29.7.
HALF_TOLERANCE = {None: 0.10, "memory": 0.15}


def half_chain_peaks(checkpoints: str | None) -> tuple[float, float]:
    """(predicted, measured) bytes of a chain of 16 float16 tanh(matmul) layers (2 MiB
    activations; float32 variables cast where read, as under Keras's mixed precision)."""

    def build():
        x = tf.Variable(tf.random.normal([2048, 512]))
        weights = [tf.Variable(tf.random.normal([512, 512]) * 0.05) for _ in range(16)]
        h = tf.cast(x, tf.float16)
        for w in weights:
            h = tf.tanh(tf.matmul(h, tf.cast(w, tf.float16)))
        return _step(tf.reduce_sum(tf.cast(h, tf.float32)), [x, *weights], checkpoints)

    return _predicted_and_measured(build)


def all_peaks() -> dict[str, tuple[float, float]]:
    """(predicted, measured) bytes of every case, after growing the allocator."""
    # One inter-op thread, as the Sessions have: the model then runs one kernel at a time.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    grow = tf.zeros([256 * 2**20 // 4])  # a free block each request is cut from
    del grow
    peaks = {f"chain {name}": chain_peaks(name) for name in CHAINS}
    peaks["applied"] = applied_peaks()
    for checkpoints in METHODS:
        peaks[f"half chain {checkpoints or 'plain'}"] = half_chain_peaks(checkpoints)
    for name in FAMILIES:
        for checkpoints in METHODS:
            peaks[f"{name} {checkpoints or 'plain'}"] = family_peaks(name, checkpoints)
    return peaks


@pytest.fixture(scope="module")
def peaks() -> dict[str, tuple[float, float]]:
    code = "import json; from tests.test_cost_model import all_peaks; "
    code += "print(json.dumps(all_peaks()))"
    return json.loads(run_python("-c", code).strip().splitlines()[-1])


@pytest.mark.parametrize("name", CHAINS)
def test_chain_peaks_are_predicted_exactly(peaks, name):
    predicted, measured = peaks[f"chain {name}"]
    assert predicted / MB == pytest.approx(measured / MB, abs=SLACK_MB)


def test_in_place_updates_are_predicted_exactly(peaks):
    predicted, measured = peaks["applied"]
    assert predicted / MB == pytest.approx(measured / MB, abs=SLACK_MB)


@pytest.mark.parametrize("checkpoints", METHODS, ids=["plain", "memory"])
def test_half_precision_matmuls_are_predicted_as_this_cpu_runs_them(peaks, checkpoints):
    predicted, measured = peaks[f"half chain {checkpoints or 'plain'}"]
    tolerance = HALF_TOLERANCE[checkpoints]
    assert abs(predicted - measured) <= tolerance * measured, (predicted / MB, measured / MB)


@pytest.mark.parametrize("checkpoints", METHODS, ids=["plain", "memory"])
@pytest.mark.parametrize("name", FAMILIES)
def test_peaks_are_predicted_within_tolerance(peaks, name, checkpoints):
    predicted, measured = peaks[f"{name} {checkpoints or 'plain'}"]
    assert measured > 2 * MB, "the step must hold tensors the allocator counts"
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted / MB, measured / MB)


def _working(tensor: tf.Tensor) -> int:
    return costs.op_cost(tensor.op, lambda _: True).working


def test_half_precision_matmuls_hold_float32_copies_on_cpu_kernels_only(monkeypatch):
    """On a CPU whose oneDNN computes neither float16 nor a fused bfloat16 MatMul natively."""
    monkeypatch.setattr(kernels, "float16_matmuls_native", lambda: False)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    monkeypatch.setattr(
        gradient_uses, "_GRADIENT_USES", {}
    )  # found for this CPU, not the real one
    with tf.Graph().as_default():
        a = tf1.placeholder(tf.float16, [256, 128])
        b = tf1.placeholder(tf.float16, [128, 64])
        product = tf.matmul(a, b)
        copies = 2 * (256 * 128 + 128 * 64 + 256 * 64) * 2  # float32: twice each float16 byte
        assert _working(product) == copies
        steps = gradient_uses.gradient_use(product.op).steps
        # Its gradient's two products, each reading the output's gradient and one operand
        # and making the other's gradient, hold as many bytes of copies each.
        assert [step.working for step in steps] == [copies, copies]
        with tf.device("/GPU:0"):
            assert _working(tf.matmul(a, b)) == 0
        assert _working(tf.matmul(tf.cast(a, tf.float32), tf.cast(b, tf.float32))) == 0
        a16, b16 = tf.cast(a, tf.bfloat16), tf.cast(b, tf.bfloat16)
        assert _working(tf.matmul(a16, b16)) == 0
        # Fused with its BiasAdd, a bfloat16 MatMul holds its result in float32.
        biased = tf.matmul(a16, b16)
        tf.nn.bias_add(biased, tf.zeros([64], tf.bfloat16))
        assert _working(biased) == 256 * 64 * 4


def test_half_precision_matmuls_hold_nothing_more_where_onednn_computes_them(monkeypatch):
    """On a CPU with AVX512_FP16 and AMX (a Sapphire Rapids), as measured by the float16 chain."""
    monkeypatch.setattr(kernels, "float16_matmuls_native", lambda: True)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx512_fp16", "amx_bf16"}))
    monkeypatch.setattr(gradient_uses, "_GRADIENT_USES", {})
    with tf.Graph().as_default():
        a = tf1.placeholder(tf.float16, [256, 128])
        product = tf.matmul(a, tf1.placeholder(tf.float16, [128, 64]))
        assert _working(product) == 0
        assert [step.working for step in gradient_uses.gradient_use(product.op).steps] == [0, 0]
        biased = tf.matmul(tf.cast(a, tf.bfloat16), tf.zeros([128, 64], tf.bfloat16))
        tf.nn.bias_add(biased, tf.zeros([64], tf.bfloat16))
        assert _working(biased) == 0


def test_float16_matmuls_are_native_only_where_onednn_runs(monkeypatch):
    kernels.float16_matmuls_native.cache_clear()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx512bw", "avx512_fp16"}))
    monkeypatch.setattr(kernels._tf, "onednn_enabled", lambda: False)
    assert not kernels.float16_matmuls_native()
    kernels.float16_matmuls_native.cache_clear()
    monkeypatch.setattr(kernels._tf, "onednn_enabled", lambda: True)
    assert kernels.float16_matmuls_native()
    kernels.float16_matmuls_native.cache_clear()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx512bw", "avx512f"}))
    assert not kernels.float16_matmuls_native()
    kernels.float16_matmuls_native.cache_clear()


def test_xla_compiled_matmuls_hold_no_float32_copies():
    found = []

    @tf.function(jit_compile=True)
    def step(a, b):
        product = tf.matmul(a, b)
        found.append(_working(product))
        return product

    step.get_concrete_function(
        tf.TensorSpec([256, 128], tf.float16), tf.TensorSpec([128, 64], tf.float16)
    )
    assert found == [0]


_PLAN_THEN_CONFIGURE = """
import tensorflow as tf
import memory_saving_gradients as msg
tf1 = tf.compat.v1
with tf.Graph().as_default():
    x = tf1.placeholder(tf.float16, [256, 128])
    weights = [tf1.get_variable(f"w{i}", [128, 128], tf.float16) for i in range(6)]
    h = x
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_sum(tf.cast(h, tf.float32))
    msg.gradients(loss, weights, checkpoints=msg.plan(loss, weights, "memory"))
tf.config.threading.set_inter_op_parallelism_threads(1)  # fails once the runtime started
print("configured")
"""


def test_planning_a_graph_leaves_tensorflows_runtime_unstarted():
    """Asking where ops run (`kernels.runs_cpu_kernels`) must not start TensorFlow's runtime,
    which would freeze the thread and device settings a graph-mode program makes later."""
    assert run_python("-c", _PLAN_THEN_CONFIGURE).strip().endswith("configured")


def test_gradient_uses_are_kept_for_a_bounded_number_of_op_kinds(monkeypatch):
    """A long-running process builds ever new kinds of op: the oldest kinds are forgotten,
    and built aside again (new ids, the same reads) when asked for."""
    monkeypatch.setattr(gradient_uses, "_GRADIENT_USES", {})
    monkeypatch.setattr(gradient_uses, "KINDS_KEPT", 2)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8])
        ops = [tf.tanh(x).op, tf.sigmoid(x).op, tf.exp(x).op]
        first = gradient_uses.gradient_use(ops[0])
        for op in ops[1:]:
            gradient_uses.gradient_use(op)
        assert len(gradient_uses._GRADIENT_USES) == 2
        again = gradient_uses.gradient_use(ops[0])
        assert (again.reads, again.needs) == (first.reads, first.needs)
        assert len(gradient_uses._GRADIENT_USES) == 2


def test_a_product_of_a_tensor_with_itself_is_a_kind_of_op_apart(monkeypatch):
    """`x * x`'s gradient reads one placeholder for both inputs; `a * b`, of the same type,
    shapes and dtypes, reads the other input for each, which it would not be told if it took
    the gradient use of `x * x`."""
    monkeypatch.setattr(gradient_uses, "_GRADIENT_USES", {})
    with tf.Graph().as_default():
        a, b = (tf.compat.v1.placeholder(tf.float32, [4, 8]) for _ in range(2))
        gradient_uses.gradient_use((a * a).op)
        product = gradient_uses.gradient_use((a * b).op)
    assert product.reads == ((frozenset({1}), frozenset()), (frozenset({0}), frozenset()))


@pytest.mark.tf2_only
def test_einsums_hold_the_copies_of_what_they_reorder_as_profiled():
    """Keras attention's einsums and their gradients (NOTE [einsum's transposes]): the scores
    `aecd,abcd->acbe` copy the keys, the queries and the scores; the weighted sum and every
    gradient copy one operand and their result, or two operands. The static model's working
    bytes equal each kernel's scratch in a profiled step; a projection reorders nothing."""
    batch, length, heads, depth = 4, 128, 4, 64  # operands of 512 KiB, above the floor
    q, k, v = (tf.Variable(tf.random.normal([batch, length, heads, depth])) for _ in range(3))
    modelled = {}

    @tf.function(autograph=False)
    def step():
        scores = tf.einsum("aecd,abcd->acbe", k, q, name="scores")
        mixed = tf.einsum("acbe,aecd->abcd", tf.tanh(scores), v, name="mixed")
        gradients = tf.gradients(tf.reduce_sum(tf.tanh(mixed)), [q, k, v])
        for op in tf1.get_default_graph().get_operations():
            if op.type == "Einsum":
                read = [kernels.tensor_bytes(t) for t in op.inputs]
                made = kernels.tensor_bytes(op.outputs[0])
                modelled[op.name] = kernels.einsum_working_bytes(op, read, made)
        return gradients

    profiled = msg.measure_costs(step).kernels
    assert len(modelled) == 6, modelled
    assert {name: profiled[name].scratch_bytes for name in modelled} == modelled
    assert modelled["scores/Einsum"] == 2 * 512 * 1024 + batch * heads * length**2 * 4
    with tf.Graph().as_default():
        projection = tf.einsum("abc,cde->abde", tf.ones([batch, length, 32]), tf.ones([32, 4, 8]))
        assert kernels.einsum_working_bytes(projection.op, [1, 1], 1) == 0
