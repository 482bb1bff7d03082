"""keras-hub causal LMs fine-tuned with Keras `fit`, as users call it, enabled.

Collected only by tests/test_keras_hub.py, which runs this module in a fresh interpreter:
importing keras-hub replaces `tf.compat.v2` with a new module object, and its models leave
TensorFlow's allocator with blocks that change the peaks later memory tests read.

Tiny models of each family people fine-tune, built from keras-hub's constructors with
`preprocessor=None` (nothing is downloaded): GPT-2, Llama, Gemma, Mistral (sliding window)
and Qwen3 with grouped-query attention and rotary embeddings, Mixtral's mixture of experts.
`fit` runs on arrays, so Keras traces its step with the batch unknown. After a few AdamW
steps the weights must equal those of Keras's own step (float32 round-off), under every
strategy, with LoRA, under `mixed_bfloat16` and compiled by XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import keras
import numpy as np
import pytest

import memory_saving_gradients as msg
from memory_saving_gradients._src.models import transformers

keras_hub = pytest.importorskip("keras_hub")

pytestmark = pytest.mark.tf2_only

SIZES = {"layers_count": 2, "hidden": 32, "heads": 4, "length": 32, "batch": 2, "batches": 2}


def block_outputs(model: keras.Model):
    """Per-block checkpoints: each decoder block's output, in one line."""
    return msg.keras.layer_outputs(*(block.name for block in model.backbone.transformer_layers))


def keep_softmaxes(view):
    """'speed''s saved tensors and every softmax whose saving spares a query-key product."""
    from memory_saving_gradients._src.planning import saving, search

    speed_set = saving.speed_saved(view)
    softmaxes = saving.sparing_contractions(view, speed_set)
    assert softmaxes and {t.op.type for t in softmaxes} == {"Softmax"}, softmaxes
    return search.least_peak_saving(view, [*speed_set, *softmaxes], "softmaxes kept")


def keep_operands(view):
    """'speed''s saved tensors inside the least-peak cuts, where some are the operands of a
    query-key product (after the rotary embedding, the transpose into heads) rather than the
    projections before them."""
    from memory_saving_gradients._src.planning import saving, search

    projections = {t.ref() for t in saving.as_dense_as_contractions(view)}
    speed_set = saving.speed_saved(view)
    assert any(t.ref() not in projections for t in speed_set), "nothing was moved"
    return search.least_peak_saving(view, speed_set, "operands kept")


def checkpoints_of(name: str, model: keras.Model):
    if name == "blocks":
        return block_outputs(model)
    if name == "budget":
        return msg.MemoryBudget(0.4)
    if name == "softmaxes":
        return keep_softmaxes
    if name == "operands":
        return keep_operands
    return name


@dataclasses.dataclass(frozen=True)
class Planned:
    """What the enabled step's plan predicted (kept apart from the plan, which would keep the
    model, its graph and its variables alive for the rest of the suite)."""

    pays: bool
    peak_bytes: int
    plain_peak_bytes: int


@functools.cache
def trained_weights(family: str, checkpoints: str | None, lora: bool, policy: str, xla: bool):
    """The weights after one epoch of `fit` (plain where `checkpoints` is None), and what the
    enabled step's plan predicted."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        task = transformers.causal_lm(family, lora_rank=4 if lora else None, **SIZES)
        if checkpoints is not None:
            msg.keras.enable(task.model, checkpoints_of(checkpoints, task.model))
        model = task.compile(jit_compile=xla)
        model.fit(task.x, task.y, batch_size=task.batch, epochs=1, shuffle=False, verbose=0)
        plan = getattr(model, "checkpoint_plan", None)
        assert checkpoints is None or plan is not None, "the enabled step was never traced"
        planned = plan and Planned(plan.pays, plan.peak_bytes, plan.plain_peak_bytes)
        return [np.asarray(w, np.float64) for w in model.get_weights()], planned
    finally:
        keras.mixed_precision.set_global_policy("float32")
        gc.collect()


def assert_trains_as_keras(
    family, checkpoints, lora=False, policy="float32", xla=False, rtol=2e-5, atol=2e-6
):
    want, _ = trained_weights(family, None, lora, policy, xla)
    have, plan = trained_weights(family, checkpoints, lora, policy, xla)
    assert plan.pays, plan  # the rewrite, not TensorFlow's own gradients, is compared
    assert len(want) == len(have)
    for i, (w, h) in enumerate(zip(want, have, strict=True)):
        np.testing.assert_allclose(h, w, rtol=rtol, atol=atol, err_msg=f"weight {i}")
    return plan


@pytest.mark.parametrize("family", sorted(transformers.HUB_FAMILIES))
def test_fit_trains_as_keras_under_speed(family):
    plan = assert_trains_as_keras(family, "speed")
    assert plan.peak_bytes <= plan.plain_peak_bytes


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fit_trains_as_keras_under_memory(family):
    assert_trains_as_keras(family, "memory")


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral"])
def test_fit_trains_as_keras_with_the_softmaxes_kept(family):
    """keras-hub's own attention (multi-head, grouped-query with rotary embeddings, a mixture
    of experts), each softmax kept and its query-key product never recomputed."""
    assert_trains_as_keras(family, "softmaxes")


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral"])
def test_fit_trains_as_keras_with_the_query_key_operands_kept(family):
    """The queries and keys saved as keras-hub's query-key product reads them (rotated and
    split into heads; for grouped-query attention, the keys before their repeat), the
    projections, rotations and transposes before them never recomputed."""
    assert_trains_as_keras(family, "operands")


def test_fit_compiled_by_xla_trains_as_keras_with_the_query_key_operands_kept():
    assert_trains_as_keras("llama", "operands", xla=True)


@pytest.mark.parametrize("checkpoints", ["budget", "blocks"])
def test_llama_fit_trains_as_keras_with_a_budget_and_block_outputs(checkpoints):
    assert_trains_as_keras("llama", checkpoints)


def test_lora_fine_tuning_trains_as_keras():
    assert_trains_as_keras("llama", "speed", lora=True)


def test_mixed_bfloat16_trains_no_farther_from_float32_than_keras():
    """In bfloat16 the order of summation moves weights: the enabled run must end no farther
    from a float32 run than Keras's own bfloat16 run does."""
    exact, _ = trained_weights("llama", None, False, "float32", False)
    keras_bf16, _ = trained_weights("llama", None, False, "mixed_bfloat16", False)
    ours, plan = trained_weights("llama", "memory", False, "mixed_bfloat16", False)
    assert plan.pays, plan

    def distance(weights):
        return max(np.abs(w - e).max() for w, e in zip(weights, exact, strict=True))

    assert distance(ours) <= 1.5 * distance(keras_bf16) + 1e-6, (
        distance(ours),
        distance(keras_bf16),
    )


def test_fit_compiled_by_xla_trains_as_keras():
    assert_trains_as_keras("gpt2", "memory", xla=True)
