"""The `memory-saving-gradients` command, run as a user runs it (`python -m`, fresh process).

Runs are kept tiny; bad options, help and version are checked in this process, where they
stop before TensorFlow's runtime is configured, and so are tiny `explain` and `bench` runs,
on the CPU whatever this process's devices.
"""

import argparse
import csv
import importlib.metadata
import logging
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from memory_saving_gradients._src.models import command as models
from memory_saving_gradients.cli import options, runtime
from memory_saving_gradients.cli.main import main
from memory_saving_gradients.cli.options import DTYPES
from tests.helpers import ROOT, run_python

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLUMNS = [
    "model", "device", "batch", "width", "size", "dtype", "depth", "method", "reference",
    "activation_mib", "memory_ratio", "step_s", "time_ratio", "build_s",
]  # fmt: skip
DEMO_METHODS = ["plain", "'speed'", "'memory'", "'balanced'", "MemoryBudget(0.25)"]


def command(*arguments: str) -> str:
    return run_python("-m", "memory_saving_gradients", *arguments)


def rows(path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture
def in_process(monkeypatch):
    """`main` run in this process: on the CPU (TensorFlow's devices here are set already),
    and without the log handler each run adds outliving the test."""
    monkeypatch.setattr(runtime, "start", lambda device: "CPU:0")
    library = logging.getLogger("memory_saving_gradients")
    handlers = list(library.handlers)
    yield
    library.handlers[:] = handlers


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return command("demo", "--quick", "--out", str(out)), out


def test_quick_demo_prints_a_table_and_writes_every_point(quick_demo):
    stdout, out = quick_demo
    assert "activation MiB" in stdout
    points = rows(out / "demo.csv")
    assert list(points[0]) == COLUMNS
    assert sorted({int(p["depth"]) for p in points}) == [4, 8, 16, 32]
    assert [p["method"] for p in points[:5]] == DEMO_METHODS
    deepest = {p["method"]: p for p in points if p["depth"] == "32"}
    assert float(deepest["'memory'"]["memory_ratio"]) < 0.6
    assert all(float(p["activation_mib"]) > 0 and float(p["step_s"]) > 0 for p in points)


def test_quick_demo_draws_a_png(quick_demo):
    image = pytest.importorskip("matplotlib.image")
    _, out = quick_demo
    png = out / "demo.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert image.imread(png).ndim == 3


def test_bench_measures_a_residual_network_against_tensorflows_recomputation(tmp_path):
    stdout = command(
        "bench", "--model", "resnet", "--depths", "2", "--batch", "2", "--builds", "1",
        "--repeats", "1", "--out", str(tmp_path),
    )  # fmt: skip
    methods = [p["method"] for p in rows(tmp_path / "bench-resnet.csv")]
    assert methods == [
        *DEMO_METHODS,
        "tf.recompute_grad",
        "plain, Session",
        "grappler heuristics",
        "grappler manual",
    ]
    assert "grappler manual: to plain, Session" in stdout


def test_explain_prints_each_plan_and_why_in_users_words(in_process, capsys):
    main(["explain", "--depth", "4", "--batch", "64", "--width", "32", "--budgets", "0.25"])
    stdout = capsys.readouterr().out
    assert "== 'speed': keeps the outputs of matmuls" in stdout
    assert "== 'memory': the least predicted peak" in stdout
    assert "within 3% of the least peak" in stdout
    assert (
        "== MemoryBudget(0.25): the least recomputation whose predicted peak is at most 25%"
        in stdout
    )
    assert "Plan ('memory'): keeps" in stdout
    assert "predicted activation peak" in stdout
    # No constant, module or parameter of the library's internals: NESTING_GAIN, `fraction`.
    assert not re.search(r"\b[A-Z]+_[A-Z_]+\b|`", stdout), stdout


def test_a_budget_below_reach_explains_memorys_plan():
    """'memory' recomputed 0.88 of the forward compute here; MemoryBudget(0.25), below
    reach, took a plan of the same peak recomputing 2.72."""
    stdout = command(
        "explain", "--model", "resnet", "--depth", "4", "--strategies", "memory",
        "--budgets", "0.25",
    )  # fmt: skip
    memory, budget = stdout.split("== MemoryBudget(0.25)")
    recomputes = [
        next(line for line in part.splitlines() if line.startswith("  recomputes"))
        for part in (memory, budget)
    ]
    assert recomputes[0] == recomputes[1], recomputes


def test_a_bad_option_stops_the_command_with_its_name():
    result = subprocess.run(
        [sys.executable, "-m", "memory_saving_gradients", "bench", "--model", "NoSuchNet"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: memory-saving-gradients bench ")
    assert "argument --model: unknown model 'NoSuchNet'" in result.stderr


@pytest.mark.parametrize(
    ("arguments", "option"),
    [
        (["bench", "--model", "NoSuchNet"], "--model"),
        (["bench", "--depths", "4", "1"], "--depths"),
        (["explain", "--depth", "1"], "--depth"),
        (["bench", "--batch", "0"], "--batch"),
        (["bench", "--strategies", "fastest"], "--strategies"),
        (["bench", "--budgets", "-0.5"], "--budgets"),
        (["bench", "--budgets", "2.0"], "--budgets"),
        (["explain", "--budgets", "40"], "--budgets"),
        (["bench", "--model", "ResNet50", "--depths", "4"], "--depths"),
        (["bench", "--model", "unet", "--depths", "5", "--size", "40"], "--depths"),
    ],
)
def test_bad_options_exit_nonzero_naming_the_option(arguments, option, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    assert stopped.value.code != 0
    assert f"argument {option}:" in capsys.readouterr().err


def test_an_unwritable_output_folder_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as stopped:
        main(["demo", "--out", str(blocker / "results")])
    assert stopped.value.code != 0
    assert "argument --out: cannot write to" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["bench", "--model", "resnet5"], ["'resnet5'", "did you mean 'resnet'", "ResNet50"]),
        (
            ["fit", "--limit", "1GiB", "--model", "ResNet50", "--grow", "depth"],
            ["cannot grow depth of model 'ResNet50'", "choose from batch"],
        ),
        (
            ["fit", "--limit", "1GiB", "--grow", "length"],
            ["cannot grow length of model 'chain'", "choose from batch, depth"],
        ),
        (["fit", "--limit", "1GiB", "--grow", "width"], ["'width'", "'batch', 'depth'"]),
        (["explain", "--dtype", "float64"], ["'float64'", "'mixed_bfloat16'"]),
        (["bench", "--model", "ResNet50", "--depths", "4"], ["ResNet50", "leave --depths out"]),
        (
            ["bench", "--model", "unet", "--depths", "5", "--size", "40"],
            ["depth 5 does not fit 40 pixels", "depths up to 4"],
        ),
        (["explain", "--frobnicate", "3"], ["unrecognized arguments: --frobnicate 3"]),
    ],
)
def test_errors_show_the_subcommands_usage_the_bad_value_and_the_choices(
    arguments, expected, capsys
):
    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: memory-saving-gradients {arguments[0]} "), err
    assert f"memory-saving-gradients {arguments[0]}: error: " in err
    for text in expected:
        assert text in err


def test_an_unwritable_output_folder_shows_demos_usage(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(blocker / "results")])
    err = capsys.readouterr().err
    assert err.startswith("usage: memory-saving-gradients demo ")
    assert f"cannot write to {blocker / 'results'}" in err


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    installed = importlib.metadata.version(options.DISTRIBUTION)
    assert capsys.readouterr().out == f"memory-saving-gradients {installed}\n"


def test_version_outside_an_install_is_the_packages_own(monkeypatch):
    import memory_saving_gradients

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert options.version() == f"{memory_saving_gradients.__version__} (not installed)"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = options.parser()
    (choices,) = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(choices)


def test_every_option_of_every_subcommand_has_help_and_shows_its_default():
    commands = subcommands()
    assert sorted(commands) == ["bench", "demo", "explain", "fit"]
    for name, parser in commands.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            assert action.help, (name, action.option_strings)
            shown = formatter._get_help_string(action)
            if action.default not in (None, False, argparse.SUPPRESS):
                assert "(default: " in shown, (name, action.option_strings)
            else:  # the help says what happens without it
                assert action.nargs == 0 or "default" in shown or action.required, shown
    bench_help = commands["bench"].format_help()
    assert re.search(r"--repeats REPEATS .*\(default: 3\)", bench_help, re.DOTALL)
    assert re.search(r"--builds BUILDS .*\(default: 2\)", bench_help, re.DOTALL)
    assert "(default: speed memory balanced)" in " ".join(bench_help.split())


def test_dtype_offers_every_precision_the_models_take():
    for parser in subcommands().values():
        dtype = [a for a in parser._actions if "--dtype" in a.option_strings]
        assert not dtype or tuple(dtype[0].choices) == DTYPES
    assert {"float32", "mixed_bfloat16", "mixed_float16"} <= set(DTYPES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_chain_computes_in_the_policys_dtype(dtype):
    """As a Keras layer does: weights in the policy's variable dtype, matmuls in its compute
    dtype, and a float32 loss."""
    model = models.build("chain", 2, models.Shape(batch=4, width=8, size=0, dtype=dtype))
    graph = tf.function(lambda: model.loss(models.unwrapped)).get_concrete_function().graph
    policy = dtype.removeprefix("mixed_")
    variable = "float32" if dtype.startswith("mixed_") else dtype
    assert {v.dtype.name for v in model.variables} == {variable}
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    assert [op.outputs[0].dtype.name for op in matmuls] == [policy, policy]
    assert graph.outputs[0].dtype == tf.float32


def test_bench_runs_a_chain_in_mixed_bfloat16(in_process, tmp_path, capsys):
    main(
        [
            "bench", "--model", "chain", "--dtype", "mixed_bfloat16", "--depths", "2",
            "--batch", "8", "--width", "8", "--strategies", "memory", "--budgets",
            "--baselines", "--builds", "1", "--repeats", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert "mixed_bfloat16" in capsys.readouterr().out.splitlines()[0]
    points = rows(tmp_path / "bench-chain.csv")
    assert [p["method"] for p in points] == ["plain", "'memory'"]
    assert {p["dtype"] for p in points} == {"mixed_bfloat16"}
