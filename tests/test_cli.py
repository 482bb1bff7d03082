"""The `memory-saving-gradients` command, run as a user runs it (`python -m`, fresh process).

Runs are kept tiny; bad options are checked in this process, where they stop before
TensorFlow's runtime is configured.
"""

import csv
import os
import subprocess
import sys

import pytest

from memory_saving_gradients.cli.main import main
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


def test_explain_prints_each_plan_and_why():
    stdout = command("explain", "--depth", "4", "--strategies", "speed", "memory", "--budgets")
    assert "== 'speed': Outputs of matmuls" in stdout
    assert "Plan ('memory'): keeps" in stdout
    assert "predicted activation peak" in stdout
    assert "MemoryBudget" not in stdout


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
