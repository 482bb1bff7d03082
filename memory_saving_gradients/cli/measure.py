"""Peak activation memory and time of one training step, for each way of computing gradients.

A step computes the loss of one batch, its gradients and an SGD update. Plain
`tf.gradients`, this library's strategies and `tf.recompute_grad` run as a `tf.function`,
the way training code calls them. Grappler's memory optimizer (`RewriterConfig`) can only be
configured for a `tf.compat.v1.Session`, so its recomputation runs the plain step in one.

Every step is built on a fresh model (same seed), run once to warm up, then once measured:
activation memory is the allocator's peak minus what was resident before the step (weights,
inputs), `profiling.peak_memory`, the smallest over a few fresh builds. Times are medians of
steps taken in turns, all methods of one depth interleaved after one untimed round, so that
the machine's drift reaches them alike; a method's time over its reference's is the median of
each turn's ratio (`profiling.turn_ratios`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence

import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import command as models
from memory_saving_gradients._src.planning import policies
from memory_saving_gradients._src.planning.policies import CheckpointsArg
from memory_saving_gradients.profiling import interleaved_step_times, peak_memory, turn_ratios

MIB = 2**20
LEARNING_RATE = 0.01


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of computing a step's gradients.

    Attributes:
      name: as tables show it.
      checkpoints: this library's `checkpoints` argument; None for `tf.gradients`.
      recompute_blocks: wrap every group of blocks in `tf.recompute_grad`.
      checkpoint_block_layers: keep the output of every block that is a Keras layer
        (`msg.keras.layer_outputs` of them), recomputing each block from its input.
      grappler: grappler's memory optimization mode ('RECOMPUTATION_HEURISTICS', 'MANUAL',
        or its default); the step then runs in a Session (MANUAL: recomputing the ops inside
        blocks).
      reference: the method it is compared with, measured in the same way.
    """

    name: str
    checkpoints: CheckpointsArg | None = None
    recompute_blocks: bool = False
    checkpoint_block_layers: bool = False
    grappler: str | None = None
    reference: str = "plain"

    @property
    def needs_blocks(self) -> bool:
        return self.recompute_blocks or self.grappler == "MANUAL"

    def applies_to(self, kind: models.Kind) -> bool:
        """Whether `kind`'s models have the blocks this method needs."""
        if self.checkpoint_block_layers:
            return kind.has_block_layers
        return kind.has_blocks or not self.needs_blocks


PLAIN = Method("plain")
#: Plain in a Session with grappler's default settings: what grappler's recomputation is
#: compared with (a Session runs steps at another speed than a tf.function).
SESSION_PLAIN = Method("plain, Session", grappler="DEFAULT_MEM_OPT")
BASELINES = {
    "recompute_grad": Method("tf.recompute_grad", recompute_blocks=True),
    "blocks": Method("per-block checkpoints", checkpoint_block_layers=True),
    "grappler-heuristics": Method(
        "grappler heuristics", grappler="RECOMPUTATION_HEURISTICS", reference=SESSION_PLAIN.name
    ),
    "grappler-manual": Method("grappler manual", grappler="MANUAL", reference=SESSION_PLAIN.name),
}


def methods(
    strategies: Sequence[str], budgets: Sequence[float], baselines: Sequence[str] = ()
) -> list[Method]:
    """Plain first, then the strategies, the budgets (fractions of plain's peak) and the
    baselines named, plain in a Session before grappler's."""
    budget_methods = [msg.MemoryBudget(fraction) for fraction in budgets]
    chosen = [
        PLAIN,
        *(Method(policies.STRATEGIES[name].label, name) for name in strategies),
        *(Method(repr(budget), budget) for budget in budget_methods),
        *(BASELINES[name] for name in baselines),
    ]
    grappler = [i for i, method in enumerate(chosen) if method.grappler]
    if grappler:
        chosen.insert(grappler[0], SESSION_PLAIN)
    return chosen


@dataclasses.dataclass(frozen=True)
class Setting:
    """How points are measured.

    Attributes:
      device: where steps run and their memory is read ('CPU:0' or 'GPU:0').
      builds: fresh builds of each step whose smallest peak is reported.
      repeats: timed steps of each method, in turns.
    """

    device: str
    builds: int = 2
    repeats: int = 3


@dataclasses.dataclass(frozen=True)
class Point:
    """What one method measured at one depth.

    Attributes:
      depth: the model's depth, as `models.Model.depth`.
      reference: the method the ratios are to.
      activation_mib: the step's peak above resident memory, in MiB.
      memory_ratio: `activation_mib` over its reference's at the same depth (plain's, or for
        grappler's recomputation plain's in a Session).
      step_s: the median seconds per step.
      time_ratio: the median of each turn's time over its reference's in that turn.
      build_s: seconds to build the step (trace and rewrite, or graph and Session).
    """

    depth: int
    method: str
    reference: str
    activation_mib: float
    memory_ratio: float
    step_s: float
    time_ratio: float
    build_s: float


class _Step:
    """A training step ready to run: `run()` takes one step and waits for it. `depth` is its
    model's, `build_s` the seconds it took to build."""

    run: Callable[[], object]
    depth: int
    build_s: float

    def close(self) -> None:
        """Release what the step holds beyond its model."""


class _FunctionStep(_Step):
    def __init__(self, model: models.Model, method: Method) -> None:
        wrap = tf.recompute_grad if method.recompute_blocks else models.unwrapped
        checkpoints = method.checkpoints
        if method.checkpoint_block_layers:
            checkpoints = msg.keras.layer_outputs(*model.block_layers)
        function = tf.function(lambda: train(model, wrap, checkpoints))
        self.depth = model.depth
        start = time.perf_counter()
        function.get_concrete_function()
        self.build_s = time.perf_counter() - start
        self.run = lambda: function().numpy()


class _SessionStep(_Step):
    """The plain step in a Session whose grappler recomputes by `method.grappler`."""

    def __init__(self, build_model: Callable[[], models.Model], method: Method) -> None:
        start = time.perf_counter()
        graph = tf.Graph()
        with graph.as_default():
            model = build_model()
            hints = _Hints()
            fetch = train(model, hints if method.grappler == "MANUAL" else models.unwrapped)
            init = tf.compat.v1.global_variables_initializer()
        self.depth = model.depth
        if hints.names:
            graph = _with_recompute_hints(graph, hints.names)
            fetch, init = (graph.get_operation_by_name(op.name) for op in (fetch.op, init))
        config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=1, use_per_session_threads=True
        )
        config.gpu_options.allow_growth = True
        rewrite = config.graph_options.rewrite_options
        rewrite.memory_optimization = type(rewrite).MemOptType.Value(method.grappler)
        self._session = tf.compat.v1.Session(graph=graph, config=config)
        self._session.run(init)
        self.build_s = time.perf_counter() - start
        self.run = lambda: self._session.run(fetch)

    def close(self) -> None:
        self._session.close()


class _Hints:
    """A `wrap` that records the ops each wrapped block makes, but its output's and stateful
    ones (variable reads, moving averages): what grappler's MANUAL mode may recompute."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __call__(self, block: models.Block) -> models.Block:
        def recorded(h: tf.Tensor) -> tf.Tensor:
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            out = block(h)
            self.names.update(
                op.name
                for op in graph.get_operations()[first:]
                if op is not out.op and not op.op_def.is_stateful
            )
            return out

        return recorded


def _with_recompute_hints(graph: tf.Graph, names: set[str]) -> tf.Graph:
    """A copy of `graph` whose ops `names` carry grappler's `_recompute_hint` attribute."""
    graph_def = graph.as_graph_def()
    for node in graph_def.node:
        if node.name in names:
            node.attr["_recompute_hint"].i = 0
    hinted = tf.Graph()
    with hinted.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return hinted


def train(
    model: models.Model, wrap: models.Wrap, checkpoints: CheckpointsArg | None = None
) -> tf.Tensor:
    """The loss, once SGD has applied the gradients (`tf.gradients`, or this library's with
    `checkpoints`). Sparse gradients are applied dense: the tables here are small."""
    loss = model.loss(wrap)
    if checkpoints is None:
        gradients = tf.gradients(loss, model.variables)  # named gradients/: grappler's targets
    else:
        gradients = msg.gradients(loss, model.variables, checkpoints=checkpoints)
    updates = [
        variable.assign_sub(LEARNING_RATE * tf.convert_to_tensor(gradient), read_value=False)
        for variable, gradient in zip(model.variables, gradients, strict=True)
        if gradient is not None
    ]
    with tf.control_dependencies(updates):
        return tf.identity(loss)


def sweep(
    name: str,
    shape: models.Shape,
    depths: Sequence[int],
    chosen: Sequence[Method],
    setting: Setting,
    progress: Callable[[str], None],
) -> list[Point]:
    """Every method of `chosen` that applies to model `name`, at every depth; `progress`
    hears one line per point."""
    applicable = [m for m in chosen if m.applies_to(models.kind_of(name))]
    for method in chosen:
        if method not in applicable:
            progress(f"{method.name}: does not apply ({name} is not made of such blocks)")
    points: list[Point] = []
    total = len(depths) * len(applicable)
    for depth in depths:
        steps: dict[str, _Step] = {}
        peaks: dict[str, float] = {}
        for method in applicable:
            peaks[method.name], steps[method.name] = _smallest_peak(
                functools.partial(_step, name, depth, shape, method), setting
            )
            step = steps[method.name]
            progress(
                f"[{len(points) + len(steps)}/{total}] depth {step.depth} {method.name}: "
                f"{peaks[method.name]:.1f} MiB (built in {step.build_s:.1f} s)"
            )
        runs = {method_name: step.run for method_name, step in steps.items()}
        times = interleaved_step_times(runs, 1 + setting.repeats)
        timed = {method_name: t[1:] for method_name, t in times.items()}  # the first untimed
        step_s = {method_name: statistics.median(t) for method_name, t in timed.items()}
        ratios = {m.reference: turn_ratios(timed, m.reference) for m in applicable}
        for method in applicable:
            steps[method.name].close()
            mib, reference_mib = peaks[method.name], peaks[method.reference]
            points.append(
                Point(
                    steps[method.name].depth,
                    method.name,
                    method.reference,
                    mib,
                    mib / reference_mib if reference_mib else math.nan,
                    step_s[method.name],
                    ratios[method.reference][method.name].median,
                    steps[method.name].build_s,
                )
            )
    return points


def _smallest_peak(build: Callable[[], _Step], setting: Setting) -> tuple[float, _Step]:
    """The smallest peak, in MiB, of `setting.builds` freshly built steps, and the last step.

    TensorFlow's executor may order one build's ops otherwise than another's, and hold more
    at once (plain 128-layer chain: 130 or 176 MiB, build by build, each stable from step to
    step); the smallest is what the step needs.
    """
    step = build()
    peaks = [peak_memory(step.run, setting.device)]
    for _ in range(setting.builds - 1):
        step.close()
        step = build()
        peaks.append(peak_memory(step.run, setting.device))
    return min(peaks) / MIB, step


def _step(name: str, depth: int, shape: models.Shape, method: Method) -> _Step:
    """The step of `method` on a fresh model."""

    def build_model() -> models.Model:
        return models.build(name, depth, shape)

    if method.grappler is not None:
        return _SessionStep(build_model, method)
    return _FunctionStep(build_model(), method)
