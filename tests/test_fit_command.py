"""`memory-saving-gradients fit`: the largest size whose step fits a limit, per method.

The search is checked on made-up peaks (linear, in allocator-like chunks, failing methods),
the command once on a tiny chain in a fresh process, its answer re-measured here, and bad
options in this process, where they stop before any model is built.
"""

import csv
import math

import pytest

from memory_saving_gradients._src.sizing import Probe, search
from memory_saving_gradients.cli.largest import Problem, failure_reason, upper_bound
from memory_saving_gradients.cli.main import main
from tests.helpers import run_python

LIMIT = "3MiB"
LIMIT_MIB = 3.0
WIDTH, DEPTH = 64, 8
FIT_COLUMNS = [
    "model", "device", "grow", "limit", "depth", "batch", "width", "size", "dtype", "method",
    "largest", "capped", "activation_mib", "step_s", "samples_per_s", "failing_value",
    "failing_mib", "probes", "note",
]  # fmt: skip


def made_up(peak_of, failure_at=None):
    """A probe whose peak is `peak_of(value)` MiB, failing from `failure_at` on; it records
    the values it was asked for."""
    asked = []

    def probe(value):
        asked.append(value)
        if failure_at is not None and value >= failure_at:
            return Probe(value, fits=False, failure="ValueError: cannot")
        peak = peak_of(value)
        return Probe(value, peak <= LIMIT_MIB, peak, 0.01)

    return probe, asked


@pytest.mark.parametrize("first", [1, 7, 400, 5000])
def test_search_finds_the_boundary_of_a_linear_peak_in_few_probes(first):
    probe, asked = made_up(lambda batch: 0.5 + 0.01 * batch)  # fits up to 250
    answer = search(probe, LIMIT_MIB, first, 1, 10**6, "plain")
    assert answer.largest == 250
    assert answer.failing.value == 251 and not answer.capped
    assert len(asked) == len(set(asked)) <= 14
    assert max(asked) <= max(first, 4 * 250)


def test_search_on_chunked_peaks_still_ends_on_adjacent_values():
    probe, asked = made_up(lambda batch: 4 * math.ceil((0.3 + 0.007 * batch) / 4) * 0.75)
    answer = search(probe, LIMIT_MIB, 100, 1, 10**6)
    assert answer.fitting.activation_mib <= LIMIT_MIB < answer.failing.activation_mib
    assert answer.failing.value == answer.largest + 1
    assert len(asked) <= 2 * math.log2(10**6)


def test_search_reports_none_fits_a_cap_and_a_failing_method():
    nothing, _ = made_up(lambda batch: 10.0)
    assert search(nothing, LIMIT_MIB, 8, 1, 100).note == "none fits"
    everything, _ = made_up(lambda batch: 0.0)
    capped = search(everything, LIMIT_MIB, 8, 1, 100)
    assert capped.largest == 100 and capped.capped
    failing, _ = made_up(lambda batch: 0.0, failure_at=1)
    failed = search(failing, LIMIT_MIB, 8, 1, 100)
    assert failed.largest is None and failed.note == "fails: ValueError: cannot"


def test_a_unets_depth_grows_only_as_far_as_its_images_halve():
    assert upper_bound("unet", "depth", 64, 100) == 7
    assert upper_bound("unet", "depth", 40, 100) == 4
    assert upper_bound("resnet", "depth", 64, 100) == 100


@pytest.mark.parametrize(
    ("grow", "depth", "batch", "size"),
    [("batch", 4, 16, 32), ("depth", 16, 8, 32), ("length", 4, 8, 16)],
)
def test_each_size_grows_its_own_dimension(grow, depth, batch, size):
    from memory_saving_gradients._src.models.command import Shape
    from memory_saving_gradients.cli import measure

    problem = Problem(
        "transformer", 4, Shape(8, 64, 32), grow, 2**20, 1, 100, "CPU:0", measure.Setting("CPU:0")
    )
    assert problem.resized(16) == (depth, Shape(batch, 64, size))
    assert problem.batch_at(16) == batch


def test_the_reason_of_a_keras_layer_failure_is_its_cause():
    error = ValueError(
        "in user code:\n\n    File x.py, line 1\n\n    ValueError: Exception encountered when "
        "calling BatchNormalization.call().\n    \n    \x1b[1mThe custom_gradient decorator "
        "currently supports keywords arguments only when eager execution is enabled.\x1b[0m\n"
        "\n    Arguments received by BatchNormalization.call():\n      • training=True\n"
    )
    assert failure_reason(error) == (
        "ValueError: The custom_gradient decorator currently supports keywords arguments "
        "only when eager execution is enabled."
    )


_AFTER_A_LARGER_TENSOR = """
import sys
import tensorflow as tf
from memory_saving_gradients.cli import largest
if sys.argv[1] == "pool":
    largest.start("cpu", 64 * 2**20)
with tf.device("CPU:0"):
    larger = tf.raw_ops.Empty(shape=[64 * 2**18], dtype=tf.float32, init=False)
    del larger
    tf.config.experimental.reset_memory_stats("CPU:0")
    smaller = tf.raw_ops.Empty(shape=[40 * 2**18], dtype=tf.float32, init=False)
print(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20)
"""


def test_on_cpu_fit_cuts_each_request_from_one_pool_as_a_gpus_allocator_does():
    """A 40 MiB tensor made after a 64 MiB one is freed: the CPU allocator, grown as steps
    ask, hands it the 64 MiB block whole; in the pool `fit` grows first it is cut to size."""
    pooled = float(run_python("-c", _AFTER_A_LARGER_TENSOR, "pool"))
    grown_as_asked = float(run_python("-c", _AFTER_A_LARGER_TENSOR, "none"))
    assert pooled == 40.0
    assert grown_as_asked == 64.0


@pytest.fixture(scope="module")
def tiny_fit(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit")
    stdout = run_python(
        "-m", "memory_saving_gradients", "fit", "--model", "chain", "--width", str(WIDTH),
        "--depth", str(DEPTH), "--batch", "256", "--limit", LIMIT, "--strategies", "memory",
        "--budgets", "--baselines", "recompute_grad", "remat-full", "--device", "cpu",
        "--out", str(out),
    )  # fmt: skip
    with (out / "fit-chain-batch.csv").open(newline="") as file:
        return stdout, {row["method"]: row for row in csv.DictReader(file)}, out


def test_fit_prints_a_row_per_method_and_writes_them(tiny_fit):
    stdout, rows, _ = tiny_fit
    assert "largest batch" in stdout and "samples/s" in stdout
    assert list(rows) == [
        "plain",
        "'memory'",
        "tf.recompute_grad",
        "keras.RematScope('full')",
    ]
    assert list(next(iter(rows.values()))) == FIT_COLUMNS
    assert "the chain has no Keras layers" in rows["keras.RematScope('full')"]["note"]
    for method in ("plain", "'memory'", "tf.recompute_grad"):
        row = rows[method]
        assert int(row["largest"]) > 1 and float(row["samples_per_s"]) > 0
        assert float(row["activation_mib"]) <= LIMIT_MIB < float(row["failing_mib"])
        assert int(row["failing_value"]) == int(row["largest"]) + 1
    assert int(rows["'memory'"]["largest"]) > int(rows["plain"]["largest"])


def test_fit_draws_a_png(tiny_fit):
    image = pytest.importorskip("matplotlib.image")
    _, _, out = tiny_fit
    assert image.imread(out / "fit-chain-batch.png").ndim == 3


def test_plains_largest_batch_is_right_within_the_spread_of_peaks_measured_again(tiny_fit):
    """The search ends on adjacent values measured to fit and not (above); measured again,
    one build's peak varies by some 15% at these sizes, so half the batch must fit and twice
    it must not."""
    _, rows, _ = tiny_fit
    from memory_saving_gradients._src.models import command as models
    from memory_saving_gradients.cli import measure

    largest = int(rows["plain"]["largest"])
    plain = measure.Method("plain", reference="plain")
    setting = measure.Setting("CPU:0", builds=2, repeats=1)

    def peak_mib(batch):
        shape = models.Shape(batch=batch, width=WIDTH, size=0)
        (point,) = measure.sweep("chain", shape, [DEPTH], [plain], setting, lambda line: None)
        return point.activation_mib

    assert peak_mib(largest // 2) <= LIMIT_MIB < peak_mib(2 * largest)


def test_fit_grows_a_keras_hub_causal_lms_sequence(tmp_path):
    """A keras-hub architecture by its family and size options: the longest sequence of a
    two-block GPT-2 of 64 hidden units in 8 MiB, plain against per-block checkpoints."""
    pytest.importorskip("keras_hub")
    stdout = run_python(
        "-m", "memory_saving_gradients", "fit", "--model", "gpt2", "--depth", "2", "--width",
        "64", "--batch", "2", "--size", "64", "--grow", "length", "--limit", "8MiB",
        "--strategies", "--budgets", "--baselines", "blocks", "--repeats", "1", "--device",
        "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    rows = {line.split()[0]: line.split() for line in stdout.splitlines() if line[:1] == "p"}
    assert "largest length" in stdout
    assert int(rows["per-block"][2]) > int(rows["plain"][1]) > 1, stdout


@pytest.mark.parametrize(
    ("arguments", "option"),
    [
        (["fit", "--limit", "2"], "--limit"),
        (["fit", "--limit", "2 parsecs"], "--limit"),
        (["fit", "--limit", "0MiB"], "--limit"),
        (["fit", "--limit", "1GiB", "--model", "NoSuchNet"], "--model"),
        (["fit", "--limit", "1GiB", "--model", "ResNet50", "--grow", "depth"], "--grow"),
        (["fit", "--limit", "1GiB", "--model", "resnet", "--grow", "length"], "--grow"),
        (["fit", "--limit", "1GiB", "--grow", "width"], "--grow"),
        (["fit", "--limit", "1GiB", "--grow", "depth", "--max", "1"], "--max"),
        (["fit", "--limit", "1GiB", "--baselines", "grappler-manual"], "--baselines"),
        (["fit", "--limit", "1GiB", "--model", "unet", "--size", "40", "--depth", "5"], "--depth"),
    ],
)
def test_bad_options_exit_nonzero_naming_the_option(arguments, option, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    assert stopped.value.code != 0
    assert f"argument {option}:" in capsys.readouterr().err


def test_a_limit_is_required(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--model", "resnet"])
    assert stopped.value.code != 0
    assert "required: --limit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 * 2**30), ("1.5 MB", 1_500_000), ("64mib", 64 * 2**20), ("512B", 512)],
)
def test_limits_take_binary_and_decimal_units(text, expected):
    from memory_saving_gradients.cli.options import amount_of_memory

    assert amount_of_memory(text) == expected
