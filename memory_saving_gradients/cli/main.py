"""The `memory-saving-gradients` command: each subcommand run on the options `cli.options`
parses, which are checked before any model is built.

    memory-saving-gradients demo [--quick] [--out DIR]
    memory-saving-gradients bench --model resnet --depths 4 8 16 --budgets 0.25 0.5
    memory-saving-gradients explain --model ResNet50 --strategies memory balanced
    memory-saving-gradients fit --model resnet --limit 64MiB --grow batch
    memory-saving-gradients bench --model chain --dtype mixed_bfloat16
    memory-saving-gradients bench --suite chain fit [--quick] [--results DIR]
    memory-saving-gradients --version

Tables go to stdout, progress to stderr; `demo`, `bench` and `fit` also write a CSV file and,
with matplotlib installed (the `demo` extra), a plot; `bench --suite` writes results pages
(`cli.suites`).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memory_saving_gradients.cli import options
from memory_saving_gradients.cli.options import (
    DEMO_BUDGET,
    DEMO_BUILDS,
    DEMO_QUICK,
    DEMO_REPEATS,
    STRATEGIES,
    OptionError,
)

if TYPE_CHECKING:
    from memory_saving_gradients._src.models.command import Shape


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: the process's); returns the exit status."""
    args, unknown = options.parser().parse_known_args(argv)
    # Each subcommand reports its own errors with its own usage, those found after parsing
    # (a model that does not exist, a size it does not take) too.
    command: argparse.ArgumentParser = args.parser
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    from memory_saving_gradients.cli import runtime

    runtime.quiet()  # before anything imports TensorFlow
    try:
        return _RUNS[args.command](args)
    except OptionError as error:
        command.error(str(error))


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
    if args.suite:
        return _suites(args)
    if args.quick:
        raise OptionError("--quick", "sizes the suites: give it with --suite")
    return _measure(args, stem=f"bench-{args.model}")


def _suites(args: argparse.Namespace) -> int:
    """Run each suite named and write its page; the suites choose their own models."""
    given = [
        option
        for option, value in (
            ("--model", args.model != "chain"),
            ("--depths", args.depths),
            ("--batch", args.batch),
            ("--width", args.width),
            ("--size", args.size),
        )
        if value
    ]
    if given:
        raise OptionError(
            given[0], "a suite measures its own models and sizes: leave it out with --suite"
        )
    _check_writable(args.results, "--results")
    device = _start(args.device)
    from memory_saving_gradients.cli import suites

    options = [
        *(["--quick"] if args.quick else []),
        *(["--device", args.device] if args.device != "auto" else []),
    ]
    for name in args.suite:
        _progress(f"suite {name}: {suites.SUITES[name]}")
        start = time.perf_counter()
        page = suites.run(name, args.results, device, args.quick, options)
        print(f"wrote {page} ({time.perf_counter() - start:.0f} s)")
    return 0


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
        raise OptionError(
            "--grow",
            f"cannot grow {args.grow} of model {args.model!r}: {why}; choose from "
            f"{', '.join(growable)}",
        )
    depth = depths[0] if args.depth or args.grow == "depth" else depths[len(depths) // 2]
    lower = 2 if args.grow == "depth" else 1
    from memory_saving_gradients.cli import largest, largest_report, measure, runtime

    upper = largest.upper_bound(args.model, args.grow, shape.size, args.max)
    if upper < lower:
        raise OptionError("--max", f"must be at least {lower} to grow {args.grow}, got {args.max}")
    _check_writable(args.out)
    runtime.warn_once()
    try:
        device = largest.start(args.device, args.limit)
    except runtime.NoGpuError as error:
        raise OptionError("--device", f"gpu: {error}; choose auto or cpu") from None
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
      OptionError: the model does not exist, or does not take these sizes.
    """
    from memory_saving_gradients._src.models import command as models

    applications = models.application_names()
    if args.model not in models.KINDS and args.model not in applications:
        close = difflib.get_close_matches(args.model, [*models.KINDS, *applications], n=3)
        guess = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise OptionError(
            "--model",
            f"unknown model {args.model!r}{guess}: choose from {', '.join(models.KINDS)}, "
            f"or a keras.applications name: {', '.join(applications)}",
        )
    kind = models.kind_of(args.model)
    if depths and not kind.takes_depth:
        raise OptionError(
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
        raise OptionError(
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
            raise OptionError(
                depth_option,
                f"a U-Net of depth d halves its images d - 1 times, so --size must be "
                f"divisible by 2**(d - 1): depth {too_deep[0]} does not fit {shape.size} "
                f"pixels; choose {f'depths up to {deepest}' if deepest >= 2 else 'an even size'}"
                f", or a size such as {2**halvings * max(1, shape.size // 2**halvings)}",
            )
    return shape, depths


def _check_writable(folder: Path, option: str = "--out") -> None:
    probe = folder / ".memory-saving-gradients-probe"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise OptionError(
            option,
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
        raise OptionError("--device", f"gpu: {error}; choose auto or cpu") from None


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


#: What runs each subcommand.
_RUNS = {"demo": _demo, "bench": _bench, "explain": _explain, "fit": _fit}
