"""The options of the `memory-saving-gradients` command: its parser, what each option takes
and its defaults, checked as they are parsed (`cli.main` runs the subcommands).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

from memory_saving_gradients.cli.suites import SUITES

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
#: Where `bench --suite` writes its pages and plots unless --results says otherwise: the
#: results pages of the docs.
SUITE_RESULTS = Path("docs/results")
#: The most `fit` grows a size to unless --max says otherwise.
FIT_MAX = 2**20
#: Multiples of a byte that --limit takes.
UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


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


def parser() -> argparse.ArgumentParser:
    """The command's parser; each subcommand's namespace names it (`command`) and holds its
    own parser (`parser`), whose usage its errors print."""
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
    demo.set_defaults(command="demo", parser=demo)

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
    bench.add_argument(
        "--suite",
        nargs="+",
        choices=list(SUITES),
        metavar="NAME",
        help="run these named suites instead, each at its own models and sizes, and write "
        "each one's results page (tables, plots, machine, versions and date) into --results: "
        + "; ".join(f"{name}: {what}" for name, what in SUITES.items())
        + " (default: none, measure --model at --depths)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="with --suite: at small sizes, a minute or two each on two CPU cores",
    )
    bench.add_argument(
        "--results",
        type=Path,
        default=SUITE_RESULTS,
        metavar="DIR",
        help="with --suite: folder for each suite's page and plots, made if missing",
    )
    bench.set_defaults(command="bench", parser=bench)

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
    explain.set_defaults(command="explain", parser=explain)

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
        type=amount_of_memory,
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
    fit.set_defaults(command="fit", parser=fit)
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


def amount_of_memory(text: str) -> int:
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


class OptionError(Exception):
    """An option's value that cannot be used; the message names the option."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")
