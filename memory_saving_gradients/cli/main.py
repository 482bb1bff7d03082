"""Options of the `memory-saving-gradients` command, checked before any model is built.

    memory-saving-gradients demo [--quick] [--out DIR]
    memory-saving-gradients bench --model resnet --depths 4 8 16 --budgets 0.25 0.5
    memory-saving-gradients explain --model ResNet50 --strategies memory balanced
    memory-saving-gradients fit --model resnet --limit 64MiB --grow batch
    memory-saving-gradients bench --model chain --dtype mixed_bfloat16
    memory-saving-gradients --version

Tables go to stdout, progress to stderr; `demo`, `bench` and `fit` also write a CSV file and,
with matplotlib installed (the `demo` extra), a plot.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memory_saving_gradients._src.models.command import Shape

STRATEGIES = ("speed", "memory", "balanced")
BASELINES = ("recompute_grad", "grappler-heuristics", "grappler-manual")
#: What `bench --baselines` may name besides: per-block checkpoints (keras-hub causal LMs).
BENCH_BASELINES = (*BASELINES, "blocks")
DEVICES = ("auto", "cpu", "gpu")
#: The Keras dtype policies every model of the command is built under (the chain follows the
#: policy as a Keras layer does): float32, mixed precision (half-precision compute on float32
#: variables) and half precision throughout.
DTYPES = ("float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "float16")
#: The distribution whose version `--version` reports.
DISTRIBUTION = "memory_saving_gradients"
#: The demo: the chain at its default sizes, plain against every strategy and a budget; with
#: --quick, at these depths, batch and width.
DEMO_QUICK = ((4, 8, 16, 32), 512, 128)
DEMO_BUDGET = 0.25
DEMO_REPEATS = 5
DEMO_BUILDS = 2
#: What `fit --baselines` may name: tf.recompute_grad over blocks, keras.RematScope modes,
#: per-block checkpoints.
FIT_BASELINES = ("recompute_grad", "remat-full", "remat-activations", "remat-larger", "blocks")
FIT_DEFAULT_BASELINES = ("recompute_grad", "remat-full", "remat-activations")
#: The sizes `fit` can grow: every model's batch, the depth of models made of blocks, the
#: transformer's sequence length.
GROWABLE = ("batch", "depth", "length")
#: The most `fit` grows a size to unless --max says otherwise.
FIT_MAX = 2**20
#: Multiples of a byte that --limit takes.
UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: the process's); returns the exit status."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    # Each subcommand reports its own errors with its own usage, those found after parsing
    # (a model that does not exist, a size it does not take) too.
    command: argparse.ArgumentParser = args.parser
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    from memory_saving_gradients.cli import runtime

    runtime.quiet()  # before anything imports TensorFlow
    try:
        return args.run(args)
    except _OptionError as error:
        command.error(str(error))


def version() -> str:
    """The installed distribution's version; from a source tree that is not installed, the
    package's own `__version__`, marked as such."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        import memory_saving_gradients

        return f"{getattr(memory_saving_gradients, '__version__', 'unknown')} (not installed)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, as the command line writes it (lists
    space-separated), where it has one worth showing: not None (the help says what happens
    then), not a flag's False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" in text
            or not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
        ):
            return text
        default = action.default
        shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown or 'none'})".replace("%", "%%")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memory-saving-gradients",
        description="Peak memory and step time of checkpointed gradients (TensorFlow 2).",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {version()}",
        help="print the installed version and exit",
    )
    parser.set_defaults(parser=parser)
    commands = parser.add_subparsers(required=True, metavar="{demo,bench,explain,fit}")

    demo = commands.add_parser(
        "demo",
        formatter_class=_HelpFormatter,
        help="a deep tanh(matmul) chain, plain tf.gradients against every strategy",
        description="Peak activation memory and step time of a chain of tanh(matmul) layers "
        "at four depths: plain tf.gradients against the "
        f"strategies {', '.join(STRATEGIES)} and MemoryBudget({DEMO_BUDGET}). About a minute "
        "or two on two CPU cores.",
    )
    demo.add_argument("--quick", action="store_true", help="smaller and shallower: under a minute")
    _add_out(demo)
    demo.set_defaults(run=_demo, parser=demo)

    bench = commands.add_parser(
        "bench",
        formatter_class=_HelpFormatter,
        help="any model, strategies and budgets, against TensorFlow's own recomputation",
        description="Peak activation memory and step time of a model at several depths, "
        "plain tf.gradients against strategies, memory budgets and TensorFlow's own "
        "recomputation (tf.recompute_grad over blocks, grappler's memory optimizer).",
    )
    _add_model(bench)
    bench.add_argument(
        "--depths",
        type=_depth,
        nargs="+",
        metavar="DEPTH",
        help="depths to measure, each at least 2 (default: the model's own, such as 8 16 32 "
        "64 layers of the chain)",
    )
    _add_methods(bench)
    bench.add_argument(
        "--baselines",
        nargs="*",
        choices=BENCH_BASELINES,
        default=list(BASELINES),
        help="TensorFlow's own recomputation to measure too: tf.recompute_grad over groups of "
        "blocks, grappler's memory optimizer (heuristics, or manual on the blocks' ops); "
        "blocks: checkpoints at every decoder block's output (keras-hub causal LMs); none "
        "with an empty list",
    )
    bench.add_argument(
        "--repeats",
        type=_positive,
        default=3,
        help="timed steps per method and depth, taken in turns; the median is reported",
    )
    bench.add_argument(
        "--builds",
        type=_positive,
        default=2,
        help="fresh builds per method and depth; the smallest peak is reported, since "
        "TensorFlow's executor may schedule one build's ops otherwise than another's",
    )
    _add_device(bench)
    _add_out(bench)
    bench.set_defaults(run=_bench, parser=bench)

    explain = commands.add_parser(
        "explain",
        formatter_class=_HelpFormatter,
        help="what each strategy keeps and its predicted peak, without running a step",
        description="Print the plan of each strategy for a model: the tensors it keeps, the "
        "predicted activation peak with and without them, and the forward compute it repeats.",
    )
    _add_model(explain)
    explain.add_argument(
        "--depth",
        type=_depth,
        help="the model's depth, at least 2 (default: the smallest of its own, such as 8 "
        "layers of the chain)",
    )
    _add_methods(explain)
    explain.set_defaults(run=_explain, parser=explain)

    fit = commands.add_parser(
        "fit",
        formatter_class=_HelpFormatter,
        help="the largest batch, depth or sequence length whose step fits a memory limit",
        description="For each method (plain tf.gradients, strategies, budgets, "
        "tf.recompute_grad over blocks, keras.RematScope), the largest value of one size "
        "whose training step fits the limit: on CPU its measured activation peak (the step's "
        "peak above resident weights and inputs), on a GPU the device given that much memory.",
    )
    _add_model(fit)
    fit.add_argument(
        "--limit",
        type=_bytes,
        required=True,
        help="memory limit with its unit, such as 2GiB or 500MB (required)",
    )
    fit.add_argument(
        "--grow",
        choices=GROWABLE,
        default="batch",
        help="the size to search: batch, depth (of every model but keras.applications ones) "
        "or length (the sequence length of the transformer and keras-hub models)",
    )
    fit.add_argument(
        "--depth",
        type=_depth,
        help="the model's depth, at least 2; with --grow depth, where the search starts "
        "(default: the middle of its own depths, such as 32 layers of the chain; with --grow "
        "depth, the smallest)",
    )
    _add_methods(fit)
    fit.add_argument(
        "--baselines",
        nargs="*",
        choices=FIT_BASELINES,
        default=list(FIT_DEFAULT_BASELINES),
        help="TensorFlow's and Keras's own recomputation to search too: tf.recompute_grad "
        "over groups of blocks, keras.RematScope in its modes; blocks: checkpoints at every "
        "decoder block's output (keras-hub causal LMs); none with an empty list",
    )
    fit.add_argument("--max", type=_positive, default=FIT_MAX, help="the most to grow the size to")
    fit.add_argument(
        "--repeats",
        type=_positive,
        default=2,
        help="timed steps per probe; the median is reported",
    )
    fit.add_argument(
        "--builds",
        type=_positive,
        default=1,
        help="fresh builds per probe; the smallest peak is reported",
    )
    _add_device(fit)
    _add_out(fit)
    fit.set_defaults(run=_fit, parser=fit)
    return parser


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="chain",
        metavar="NAME",
        help="chain, resnet, densenet, unet, transformer, a keras-hub causal LM family "
        "(gpt2, llama, gemma, mistral, qwen3, mixtral; --depth decoder blocks, --width "
        "hidden units, --size tokens), or a keras.applications name such as ResNet50 or "
        "MobileNetV2",
    )
    parser.add_argument("--batch", type=_positive, help="batch size (default: per model)")
    parser.add_argument(
        "--width",
        type=_positive,
        help="units of the chain, channels of the CNNs (growth of densenet), model "
        "dimension of the transformer (default: per model)",
    )
    parser.add_argument(
        "--size",
        type=_positive,
        help="image side, or the sequence length of the transformer and keras-hub models "
        "(default: per model)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the Keras dtype policy the model is built under: mixed_bfloat16 (the one for "
        "CPUs) and mixed_float16 (for GPUs) compute in half precision on float32 weights; "
        "bfloat16 and float16 keep the weights in half precision too",
    )


def _add_methods(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategies",
        nargs="*",
        choices=STRATEGIES,
        default=list(STRATEGIES),
        help="checkpointing strategies (checkpoints='speed', ...); none with an empty list",
    )
    parser.add_argument(
        "--budgets",
        type=_fraction,
        nargs="*",
        metavar="FRACTION",
        default=[DEMO_BUDGET],
        help="memory budgets as fractions of plain backprop's predicted peak, each between 0 "
        "and 1 (MemoryBudget(0.25)); none with an empty list",
    )


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where steps run: auto is a GPU where TensorFlow sees one, else the CPU",
    )


def _add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="folder for the CSV file and plot, made if missing",
    )


def _positive(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _depth(text: str) -> int:
    value = _integer(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"a depth must be at least 2, got {text}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]+)\s*", text)
    if not match or match[2].upper() not in UNITS:
        raise argparse.ArgumentTypeError(
            f"not an amount of memory: {text!r} (use a unit: B, KiB, MiB, GiB, KB, MB, GB)"
        )
    value = int(float(match[1]) * UNITS[match[2].upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(
            f"a budget is a fraction of plain's peak between 0 and 1 (0.4 for 40%), got {text}"
        )
    return value


class _OptionError(Exception):
    """An option's value that cannot be used; the message names the option."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")


def _demo(args: argparse.Namespace) -> int:
    depths, batch, width = DEMO_QUICK if args.quick else (None, None, None)
    bench = argparse.Namespace(
        model="chain",
        depths=depths,
        batch=batch,
        width=width,
        size=None,
        dtype="float32",
        strategies=list(STRATEGIES),
        budgets=[DEMO_BUDGET],
        baselines=[],
        repeats=DEMO_REPEATS,
        builds=DEMO_BUILDS,
        device="auto",
        out=args.out,
    )
    return _measure(bench, stem="demo")


def _bench(args: argparse.Namespace) -> int:
    return _measure(args, stem=f"bench-{args.model}")


def _measure(args: argparse.Namespace, stem: str) -> int:
    """Measure every method at every depth; print the table, write the CSV file and plot."""
    shape, depths = _model_options(args, args.depths, "--depths")
    _check_writable(args.out)
    device = _start(args.device)
    from memory_saving_gradients._src.models import command as models
    from memory_saving_gradients.cli import measure, report

    chosen = measure.methods(args.strategies, args.budgets, args.baselines)
    print(_setting(args.model, shape, device, models.kind_of(args.model).depth_counts))
    start = time.perf_counter()
    setting = measure.Setting(device, args.builds, args.repeats)
    points = measure.sweep(args.model, shape, depths, chosen, setting, _progress)
    print(report.table(points))
    print(
        f"(activation: peak above resident memory, smallest of {args.builds} fresh builds; "
        f"step: median of {args.repeats} interleaved steps; {time.perf_counter() - start:.0f} s)"
    )
    csv_path, plot_path = args.out / f"{stem}.csv", args.out / f"{stem}.png"
    report.write_csv(points, csv_path, {"model": args.model, "device": device, **vars(shape)})
    try:
        report.plot(points, plot_path, _setting(args.model, shape, device))
        print(f"wrote {csv_path} and {plot_path}")
    except ImportError:
        print(f"wrote {csv_path}; no plot: matplotlib is missing (pip install matplotlib)")
    return 0


def _explain(args: argparse.Namespace) -> int:
    shape, depths = _model_options(args, [args.depth] if args.depth else None, "--depth")
    _start("auto")
    from memory_saving_gradients.cli import explain

    print(explain.plans(args.model, depths[0], shape, args.strategies, args.budgets))
    return 0


def _fit(args: argparse.Namespace) -> int:
    """Search each method's largest value; print the table, write the CSV file and plot."""
    shape, depths = _model_options(args, [args.depth] if args.depth else None, "--depth")
    from memory_saving_gradients._src.models import command as models

    kind = models.kind_of(args.model)
    growable = [
        "batch",
        *(["depth"] if kind.takes_depth else []),
        *(["length"] if kind.sequence else []),
    ]
    if args.grow not in growable:
        why = (
            "keras.applications models have their own depth"
            if args.grow == "depth"
            else "only the transformer and keras-hub models have a sequence length"
        )
        raise _OptionError(
            "--grow",
            f"cannot grow {args.grow} of model {args.model!r}: {why}; choose from "
            f"{', '.join(growable)}",
        )
    depth = depths[0] if args.depth or args.grow == "depth" else depths[len(depths) // 2]
    lower = 2 if args.grow == "depth" else 1
    from memory_saving_gradients.cli import largest, largest_report, measure, runtime

    upper = largest.upper_bound(args.model, args.grow, shape.size, args.max)
    if upper < lower:
        raise _OptionError(
            "--max", f"must be at least {lower} to grow {args.grow}, got {args.max}"
        )
    _check_writable(args.out)
    runtime.warn_once()
    try:
        device = largest.start(args.device, args.limit)
    except runtime.NoGpuError as error:
        raise _OptionError("--device", f"gpu: {error}; choose auto or cpu") from None
    setting = measure.Setting(device, args.builds, args.repeats)
    problem = largest.Problem(
        args.model, depth, shape, args.grow, args.limit, lower, upper, device, setting
    )
    chosen = largest.contenders(args.strategies, args.budgets, args.baselines)
    first = {"batch": shape.batch, "depth": depth, "length": shape.size}[args.grow]
    described = (
        f"{_setting(args.model, shape, device, kind.depth_counts)}"
        f"{f', depth {depth}' if kind.takes_depth else ''}; "
        f"grow {args.grow} from {first}, limit {args.limit / largest.MIB:g} MiB"
    )
    print(described)
    start = time.perf_counter()
    answers = largest.search_all(problem, chosen, first, _progress)
    print(largest_report.table(answers, problem))
    rule = (
        "its activation peak above resident memory is within the limit"
        if device == "CPU:0"
        else f"it runs on {device} given the limit as its memory"
    )
    print(f"(fits: {rule}; {time.perf_counter() - start:.0f} s)")
    stem = f"fit-{args.model}-{args.grow}"
    csv_path, plot_path = args.out / f"{stem}.csv", args.out / f"{stem}.png"
    columns = {"model": args.model, "device": device, "grow": args.grow, "limit": args.limit}
    largest_report.write_csv(
        answers, problem, csv_path, {**columns, "depth": depth, **vars(shape)}
    )
    try:
        largest_report.plot(answers, problem, plot_path, described)
        print(f"wrote {csv_path} and {plot_path}")
    except ImportError:
        print(f"wrote {csv_path}; no plot: matplotlib is missing (pip install matplotlib)")
    return 0


def _model_options(
    args: argparse.Namespace, depths: Sequence[int] | None, depth_option: str
) -> tuple[Shape, list[int]]:
    """The shape of `args.model` and the depths to build it at, defaults filled in.

    Raises:
      _OptionError: the model does not exist, or does not take these sizes.
    """
    from memory_saving_gradients._src.models import command as models

    applications = models.application_names()
    if args.model not in models.KINDS and args.model not in applications:
        close = difflib.get_close_matches(args.model, [*models.KINDS, *applications], n=3)
        guess = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise _OptionError(
            "--model",
            f"unknown model {args.model!r}{guess}: choose from {', '.join(models.KINDS)}, "
            f"or a keras.applications name: {', '.join(applications)}",
        )
    kind = models.kind_of(args.model)
    if depths and not kind.takes_depth:
        raise _OptionError(
            depth_option,
            f"{args.model} is a keras.applications model, built at its own depth: leave "
            f"{depth_option} out",
        )
    depths = list(depths or kind.depths)
    shape = models.Shape(
        batch=args.batch or kind.batch,
        width=args.width or kind.width,
        size=args.size or kind.size,
        dtype=args.dtype,
    )
    if args.model == "transformer" and shape.width % models.HEADS:
        raise _OptionError(
            "--width",
            f"the transformer's must be a multiple of its {models.HEADS} attention heads, "
            f"got {shape.width}",
        )
    if args.model == "unet":
        # Each level halves the images: depth d needs a size divisible by 2**(d - 1).
        deepest = (shape.size & -shape.size).bit_length()
        too_deep = [depth for depth in depths if depth > deepest]
        if too_deep:
            halvings = max(too_deep) - 1
            raise _OptionError(
                depth_option,
                f"a U-Net of depth d halves its images d - 1 times, so --size must be "
                f"divisible by 2**(d - 1): depth {too_deep[0]} does not fit {shape.size} "
                f"pixels; choose {f'depths up to {deepest}' if deepest >= 2 else 'an even size'}"
                f", or a size such as {2**halvings * max(1, shape.size // 2**halvings)}",
            )
    return shape, depths


def _check_writable(folder: Path) -> None:
    probe = folder / ".memory-saving-gradients-probe"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise _OptionError(
            "--out",
            f"cannot write to {folder}: {error.strerror}; give a folder that can be made and "
            "written to",
        ) from None


def _start(device: str) -> str:
    from memory_saving_gradients.cli import runtime

    runtime.quiet()
    runtime.warn_once()
    try:
        return runtime.start(device)
    except runtime.NoGpuError as error:
        raise _OptionError("--device", f"gpu: {error}; choose auto or cpu") from None


def _setting(model: str, shape: Shape, device: str, depth_counts: str | None = None) -> str:
    """One line saying what was measured: model, sizes, dtype, device."""
    import tensorflow as tf

    depth = f" (depth: {depth_counts})" if depth_counts else ""
    sizes = [f"batch {shape.batch}"]
    sizes += [f"width {shape.width}"] if shape.width else []
    sizes += [f"size {shape.size}"] if shape.size else []
    return f"{model}{depth}, {', '.join(sizes)}, {shape.dtype}, {device}, TF {tf.__version__}"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
