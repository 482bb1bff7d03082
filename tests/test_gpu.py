"""On a GPU: exact gradients, recomputed ops on the GPU, and lower peak GPU memory.

Skipped where TensorFlow sees no GPU (CI has none).
"""

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

pytestmark = pytest.mark.skipif(
    not tf.config.list_physical_devices("GPU"), reason="needs a GPU visible to TensorFlow"
)

DEPTH, WIDTH, BATCH = 36, 1024, 1024


def gpu_chain_step(checkpoints, return_gradients=False):
    """A tf.function SGD step of a tanh(matmul) chain placed on GPU:0, returning its loss (or
    its gradients), and the devices of its recomputed ops by name (filled when traced)."""
    rng = np.random.default_rng(0)
    with tf.device("/GPU:0"):
        weights = [
            tf.Variable((rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype("f4"))
            for _ in range(DEPTH)
        ]
        x = tf.constant(rng.standard_normal((BATCH, WIDTH)).astype("f4"))
    recomputed = {}

    @tf.function
    def step():
        with tf.device("/GPU:0"):
            h = x
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_mean(tf.square(h))
            if checkpoints is None:
                grads = tf.gradients(loss, weights)
            else:
                grads = msg.gradients(loss, weights, checkpoints=checkpoints)
            recomputed.update(
                (op.name, op.device)
                for op in loss.graph.get_operations()
                if "/recompute_" in op.name
            )
            for w, g in zip(weights, grads, strict=True):
                w.assign_sub(0.01 * g)
            return grads if return_gradients else loss

    return step, recomputed


def test_gradients_match_and_recomputed_ops_stay_on_the_gpu():
    plain, _ = gpu_chain_step(None, return_gradients=True)
    checkpointed, recomputed = gpu_chain_step("memory", return_gradients=True)
    for want, have in zip(plain(), checkpointed(), strict=True):
        np.testing.assert_allclose(have.numpy(), want.numpy(), rtol=1e-4, atol=1e-6)
    assert recomputed
    assert all("GPU:0" in device for device in recomputed.values()), recomputed


def test_peak_gpu_memory_drops():
    plain, _ = gpu_chain_step(None)
    checkpointed, _ = gpu_chain_step("memory")
    plain_peak = peak_memory(plain, device="GPU:0")
    checkpointed_peak = peak_memory(checkpointed, device="GPU:0")
    assert checkpointed_peak < 0.5 * plain_peak


def test_fit_command_finds_the_largest_batch_under_a_real_gpu_limit(tmp_path):
    """`fit --device gpu` gives GPU:0 the limit as its memory and counts a step that runs out
    as not fitting: 'memory' trains a larger batch of the chain than plain in 256 MiB."""
    import csv

    from tests.helpers import run_python

    run_python(
        "-m", "memory_saving_gradients", "fit", "--model", "chain", "--limit", "256MiB",
        "--strategies", "memory", "--budgets", "--baselines", "--device", "gpu",
        "--out", str(tmp_path),
    )  # fmt: skip
    with (tmp_path / "fit-chain-batch.csv").open(newline="") as file:
        rows = {row["method"]: row for row in csv.DictReader(file)}
    assert {row["device"] for row in rows.values()} == {"GPU:0"}
    assert int(rows["'memory'"]["largest"]) > int(rows["plain"]["largest"]) > 0
