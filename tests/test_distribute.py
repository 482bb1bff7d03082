"""Checkpointed gradients inside `strategy.run` of tf.distribute strategies.

Each check runs in fresh interpreters: logical devices (tests/mirrored_worker.py, two logical
CPUs) and a worker cluster (tests/multi_worker.py, two workers on localhost) cannot be
configured once TensorFlow's runtime has started.
"""

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT, assert_same_gradients, run_python

#: Seconds both workers may take together; they need about 35 on two busy cores.
TWO_WORKERS_TIMEOUT = 240


def run_worker(module: str, *arguments: str) -> dict:
    """The JSON report `python -m module arguments` prints last."""
    return json.loads(run_python("-m", module, *arguments).strip().splitlines()[-1])


def free_ports(count: int) -> list[int]:
    """`count` distinct localhost ports free at the time of the call; skips the test where
    no port can be bound."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("localhost", 0))
        return [probe.getsockname()[1] for probe in probes]
    except OSError as error:
        pytest.skip(f"cannot bind a localhost port for a worker: {error}")
    finally:
        for probe in probes:
            probe.close()


@pytest.fixture(scope="module")
def report():
    return run_worker("tests.mirrored_worker")


def test_gradients_equal_plain_mirrored_gradients(report):
    assert max(report["relative_errors"]["mirrored_plain"]) < 5e-6  # measured 6e-7


def test_gradients_summed_over_replicas_equal_one_device_gradients(report):
    # Summing two half batches instead of one batch reorders float32 sums: measured 7e-6.
    assert max(report["relative_errors"]["one_device_plain"]) < 3e-5


def test_every_recomputed_op_stays_on_its_replicas_device(report):
    placements = report["placements"]
    assert placements, "nothing was recomputed"
    for copy, copy_device, original_device in placements:
        assert copy_device == original_device, copy
    assert {device for _, device, _ in placements} == {
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:1",
    }


def test_each_replica_saves_memory_as_one_device_does(report):
    peaks = report["peaks"]
    mirrored = peaks["mirrored_checkpointed"] / peaks["mirrored_plain"]
    one_device = peaks["one_device_checkpointed"] / peaks["one_device_plain"]
    # Measured at depth 24: mirrored 0.39 (both replicas share one CPU allocator), one device 0.44.
    assert mirrored < 0.5, peaks
    assert mirrored < one_device + 0.1, peaks


def test_keras_fit_in_the_strategy_scope_matches_plain_fit(report):
    fit = report["keras_fit"]
    assert len(fit["recomputed_per_replica"]) == 2
    assert min(fit["recomputed_per_replica"]) > 0
    assert fit["max_weight_difference"] < 1e-6  # measured 4e-8


def run_two_workers(output: pathlib.Path) -> list[dict]:
    """Both workers' JSON reports. They start at once, as collective ops wait for every
    worker; one that fails stops the other, and fails the test with its stderr."""
    ports = [str(port) for port in free_ports(2)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    with contextlib.ExitStack() as logs:
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.multi_worker", str(i), *ports, str(output)],
                cwd=ROOT,
                env=environment,
                stdout=logs.enter_context((output / f"worker_{i}.out").open("w")),
                stderr=logs.enter_context((output / f"worker_{i}.err").open("w")),
            )
            for i in range(2)
        ]
        killed = wait_for_all(workers, TWO_WORKERS_TIMEOUT)
    errors = {i: (output / f"worker_{i}.err").read_text()[-4000:] for i in range(2)}
    for i, worker in enumerate(workers):
        if worker.returncode != 0 and worker not in killed:
            pytest.fail(f"worker {i} failed:\n{errors[i]}")
    if killed:
        pytest.fail(f"the workers ran past {TWO_WORKERS_TIMEOUT} s:\n{errors}")
    return [
        json.loads((output / f"worker_{i}.out").read_text().strip().splitlines()[-1])
        for i in range(2)
    ]


def wait_for_all(processes: list[subprocess.Popen], timeout: float) -> list[subprocess.Popen]:
    """Wait until every process has exited, one has failed, or `timeout` seconds have passed;
    then kill those still running and return them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [process.poll() for process in processes]
        if None not in codes or any(code not in (None, 0) for code in codes):
            break
        time.sleep(0.5)
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.kill()
        process.wait()
    return running


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Each worker's report and gradients (a dict of arrays, see tests/multi_worker.py)."""
    output = tmp_path_factory.mktemp("two_workers")
    reports = run_two_workers(output)
    gradients = [dict(np.load(output / f"worker_{i}.npz")) for i in range(2)]
    return reports, gradients


def worker_gradients(gradients: dict, kind: str, method: str) -> list[np.ndarray]:
    """One worker's gradients of `kind` (local or reduced) by `method`, in variable order."""
    count = sum(name.startswith(f"{kind}_{method}_") for name in gradients)
    return [gradients[f"{kind}_{method}_{i}"] for i in range(count)]


def test_each_worker_s_checkpointed_gradients_equal_plain(two_workers):
    reports, gradients = two_workers
    for report, found in zip(reports, gradients, strict=True):
        assert report["recomputed_ops"] > 0, report
        for kind in ("local", "reduced"):
            plain = worker_gradients(found, kind, "plain")
            assert len(plain) == report["variables"]
            # Measured: 3e-6 of each gradient's largest entry.
            assert_same_gradients(plain, worker_gradients(found, kind, "checkpointed"), rtol=1e-5)


def test_both_workers_hold_the_same_sum_of_both_shards_gradients(two_workers):
    _, (first, second) = two_workers
    for method in ("plain", "checkpointed"):
        shards = [worker_gradients(found, "local", method) for found in (first, second)]
        assert not np.allclose(shards[0][0], shards[1][0]), "the workers' shards are the same"
        reduced = worker_gradients(first, "reduced", method)
        for a, b in zip(reduced, worker_gradients(second, "reduced", method), strict=True):
            np.testing.assert_array_equal(a, b)
        sums = [a + b for a, b in zip(*shards, strict=True)]
        assert_same_gradients(sums, reduced, rtol=1e-6)


def test_each_worker_saves_memory(two_workers):
    reports, _ = two_workers
    for report in reports:
        peaks = report["peaks"]
        # Measured: 59 MiB plain, 29 MiB checkpointed on each worker.
        assert peaks["checkpointed"] < 0.6 * peaks["plain"], report
