"""The cost model against TensorFlow: predicted and measured activation peaks of one step.

For each model and each way of computing gradients (plain `tf.gradients`, then each strategy
given), the activation peak `msg.plan` predicts (`Plan.plain_peak_bytes`, `Plan.peak_bytes`)
is set beside the one measured. Each point builds its step in a fresh graph and runs it in
--sessions fresh `tf.compat.v1.Session`s, each with one inter-op thread of its own
(`use_per_session_threads`): a warm-up step, then the allocator's peak above what was
resident before the step (`profiling.peak_memory`). Sessions of one graph may differ: the
executor times ops to choose which of the ready ones wait, so one Session may hold other
tensors at once than the next: the error is against the smallest peak (as test_memory and
the command report peaks), "worst" against the Session furthest from the prediction. The
step fetches the gradients, so they live to the end of the step, as the cost model assumes.

The allocator counts more, and less, than tensors. A request is served whole from a free
block of up to twice its size, so a peak depends on the blocks earlier steps left: the
process first makes one free block far larger than any step, from which each request is cut
to its size (the "grown allocator" of benchmarks/xla.py). And TensorFlow's CPU allocator does
not count requests under 256 KiB. So the table also gives the step's tensors: the largest
total of live tensor bytes, of every size, from the allocation records of one more step, run
traced (`RunMetadata`).

    python benchmarks/cost_model.py                 # five families, plain, 'memory' and
                                                    # 'balanced': about 4 minutes on 2 cores
    python benchmarks/cost_model.py --targets       # exit 1 unless the families' errors are
                                                    # within 20%
    python benchmarks/cost_model.py --families --applications DenseNet121 MobileNetV2
                                                    # keras.applications models, 96x96, batch
                                                    # 16: about 6 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import command as models
from memory_saving_gradients.profiling import peak_memory

tf1 = tf.compat.v1
tf.get_logger().setLevel("ERROR")

MiB = 2**20
#: Issue 10: predicted peaks within this fraction of the smallest measured ones.
TARGET_ERROR = 0.20
#: MiB of the free block made before any step (see the module docstring).
GROWN_MIB = 1024


@dataclasses.dataclass(frozen=True)
class Case:
    """A model of `memory_saving_gradients._src.models.command` at one depth and shape."""

    model: str
    depth: int
    shape: models.Shape

    def describe(self) -> str:
        s = self.shape
        if self.model not in models.KINDS:
            return f"keras.applications.{self.model}, {s.size}x{s.size}, batch {s.batch}"
        kind = models.KINDS[self.model]
        sizes = f"batch {s.batch}, width {s.width}" + (f", size {s.size}" if s.size else "")
        return f"{self.model}, {self.depth} {kind.depth_counts}, {sizes}"


#: The issue's five families, at sizes whose tensors are mostly of 256 KiB or more.
FAMILIES = {
    "chain": Case("chain", 16, models.Shape(batch=2048, width=256, size=0)),
    "resnet50": Case("ResNet50", 0, models.Shape(batch=16, width=0, size=64)),
    "densenet": Case("densenet", 8, models.Shape(batch=8, width=12, size=32)),
    "unet": Case("unet", 3, models.Shape(batch=4, width=16, size=64)),
    "transformer": Case("transformer", 2, models.Shape(batch=8, width=64, size=128)),
}


@dataclasses.dataclass(frozen=True)
class Point:
    """One model and method: predicted bytes, measured bytes in each Session, and the peak of
    live tensor bytes in a traced step."""

    predicted: int
    measured: tuple[int, ...]
    tensors: int

    @property
    def error(self) -> float:
        """Against the smallest peak measured: what the step needs, in the best order."""
        return self.predicted / min(self.measured) - 1

    @property
    def worst_error(self) -> float:
        """Against the Session furthest from the prediction."""
        return max((self.predicted / m - 1 for m in self.measured), key=abs)


def _keep_nothing(view: msg.ForwardView) -> msg.Plan:
    """A plan keeping no checkpoints: its predicted peak is plain backprop's."""
    return msg.Plan(view, [], "plain")


def measure(case: Case, method: str | None, sessions: int) -> Point:
    """Predict the step of `method` (None: plain) on a fresh build and measure it in
    `sessions` fresh Sessions. The step fetches the gradients: they are held to its end."""
    graph = tf.Graph()
    with graph.as_default():
        model = models.build(case.model, case.depth, case.shape)
        loss = model.loss(models.unwrapped)
        if method is None:
            plan = msg.plan(loss, model.variables, checkpoints=_keep_nothing, gradients_held=True)
            gradients = tf.gradients(loss, model.variables)
        else:
            plan = msg.plan(loss, model.variables, checkpoints=method, gradients_held=True)
            gradients = msg.gradients(loss, model.variables, checkpoints=plan)
        fetch = [g for g in gradients if g is not None]
        init = tf1.global_variables_initializer()
    config = tf1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
    measured = []
    for _ in range(sessions):
        with tf1.Session(graph=graph, config=config) as session:
            session.run(init)
            measured.append(peak_memory(lambda: session.run(fetch)))
            tensors = _tensor_peak(session, fetch)
    return Point(plan.peak_bytes, tuple(measured), tensors)


def _tensor_peak(session: tf1.Session, fetch) -> int:
    """The largest total of live tensor bytes in one traced step, from its allocation
    records (every size, as requested)."""
    metadata = tf1.RunMetadata()
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
    session.run(fetch, options=options, run_metadata=metadata)
    records = [
        (record.alloc_micros, record.alloc_bytes)
        for device in metadata.step_stats.dev_stats
        for node in device.node_stats
        for memory in node.memory
        for record in memory.allocation_records
    ]
    live = peak = 0
    for _, size in sorted(records, key=lambda r: r[0]):
        live += size
        peak = max(peak, live)
    return peak


def _row(label: str, method: str, point: Point) -> str:
    low, high = min(point.measured) / MiB, max(point.measured) / MiB
    spread = f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"
    tensors = point.predicted / point.tensors - 1
    return (
        f"{label:<12}{method:<12}{point.predicted / MiB:>10.2f}{spread:>14}"
        f"{point.error:>+8.1%}{point.worst_error:>+8.1%}{point.tensors / MiB:>10.2f}"
        f"{tensors:>+8.1%}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument(
        "--applications",
        nargs="*",
        default=[],
        metavar="NAME",
        help="keras.applications models too (weights=None), e.g. DenseNet121 MobileNetV2",
    )
    parser.add_argument("--size", type=int, default=96, help="image side of --applications")
    parser.add_argument("--batch", type=int, default=16, help="batch of --applications")
    parser.add_argument("--strategies", nargs="*", default=["memory", "balanced"])
    parser.add_argument("--sessions", type=int, default=3, help="fresh Sessions per point")
    parser.add_argument(
        "--targets",
        action="store_true",
        help=f"exit 1 unless the families' predicted peaks are within {100 * TARGET_ERROR:.0f}"
        "%% of the smallest measured",
    )
    args = parser.parse_args(argv)
    grow = tf.zeros([GROWN_MIB * MiB // 4])  # the free block each request is cut from
    del grow
    cases = {name: FAMILIES[name] for name in args.families}
    shape = models.Shape(batch=args.batch, width=0, size=args.size)
    cases.update({name: Case(name, 0, shape) for name in args.applications})
    print(
        f"Cost model against TensorFlow {tf.__version__} (float32, Session, one inter-op "
        f"thread); MiB above resident memory"
    )
    for name, case in cases.items():
        print(f"  {name}: {case.describe()}")
    print(
        f"{'model':<12}{'method':<12}{'predicted':>10}{'measured':>14}{'error':>8}"
        f"{'worst':>8}{'tensors':>10}{'error':>8}"
    )
    errors = {}
    for name, case in cases.items():
        for method in [None, *args.strategies]:
            label = "plain" if method is None else repr(method)
            point = measure(case, method, args.sessions)
            errors[name, label] = point.error
            print(_row(name, label, point), flush=True)
    print(
        f"(measured: allocator peak, grown allocator, range over {args.sessions} Sessions; "
        "error: predicted against the smallest; worst: against the Session furthest from it; "
        "tensors: live tensor bytes at their peak in a traced step, every size, and the "
        "error against that)"
    )
    if not args.targets:
        return 0
    checks = {
        f"{name} {label}: predicted within {TARGET_ERROR:.0%} of measured": abs(e) <= TARGET_ERROR
        for (name, label), e in errors.items()
        if name in FAMILIES
    }
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
