"""Transformers trained with Keras `fit`, as users build them: an encoder classifier and a
causal decoder of Keras layers, and causal language models of keras-hub's families, built
from their constructors at small sizes (nothing is downloaded; keras-hub is the extra
`[hub]`).

Each builder returns a `Task`: the model (not compiled), the arrays `fit` takes (several
batches), its loss and the optimizer the tests and suites train it with. Every value comes from a
seed, so that a task built twice trains the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np
from keras import layers


@dataclasses.dataclass
class Task:
    """A model and what `fit` trains it on.

    Attributes:
      model: the Keras model, not compiled.
      x, y: inputs and targets of `batches` batches of `batch` samples.
      batch: samples a step.
      loss: the Keras loss to compile with.
      optimizer: builds the optimizer to compile with (a new one each call).
    """

    model: keras.Model
    x: np.ndarray | dict[str, np.ndarray]
    y: np.ndarray
    batch: int
    loss: keras.losses.Loss
    optimizer: Callable[[], keras.optimizers.Optimizer]

    def compile(self, **options) -> keras.Model:
        """The model compiled with the task's loss and a new optimizer."""
        self.model.compile(optimizer=self.optimizer(), loss=self.loss, **options)
        return self.model


def _momentum() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.01, momentum=0.9)


def _adamw() -> keras.optimizers.Optimizer:
    return keras.optimizers.AdamW(1e-4, weight_decay=0.01)


def _tokens(seed: int, batch: int, length: int, vocabulary: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocabulary, (batch, length)).astype("i4")


def encoder(
    blocks: int = 8,
    width: int = 64,
    heads: int = 4,
    length: int = 256,
    batch: int = 8,
    batches: int = 4,
    dropout: float = 0.1,
    vocabulary: int = 1000,
    classes: int = 10,
) -> Task:
    """Pre-norm encoder blocks (`keras.layers.MultiHeadAttention` with attention dropout, a
    GELU MLP of 4 * width) classifying the mean token."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    h = layers.Embedding(vocabulary, width)(tokens)
    for _ in range(blocks):
        a = layers.LayerNormalization()(h)
        h = h + layers.MultiHeadAttention(heads, width // heads, dropout=dropout)(a, a)
        m = layers.Dense(4 * width, activation="gelu")(layers.LayerNormalization()(h))
        h = h + layers.Dense(width)(m)
    pooled = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(h))
    model = keras.Model(tokens, layers.Dense(classes)(pooled))
    samples = batch * batches
    return Task(
        model,
        _tokens(1, samples, length, vocabulary),
        (np.arange(samples) % classes).astype("i4"),
        batch,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        _momentum,
    )


def decoder(
    blocks: int = 6,
    width: int = 256,
    heads: int = 4,
    length: int = 512,
    batch: int = 4,
    batches: int = 4,
    vocabulary: int = 512,
) -> Task:
    """Pre-norm causal decoder blocks (causal `MultiHeadAttention`, a GELU MLP of
    4 * width) predicting the next token at every position."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    h = layers.Embedding(vocabulary, width)(tokens)
    for _ in range(blocks):
        a = layers.LayerNormalization()(h)
        h = h + layers.MultiHeadAttention(heads, width // heads)(a, a, use_causal_mask=True)
        m = layers.Dense(4 * width, activation="gelu")(layers.LayerNormalization()(h))
        h = h + layers.Dense(width)(m)
    model = keras.Model(tokens, layers.Dense(vocabulary)(layers.LayerNormalization()(h)))
    text = _tokens(1, batch * batches, length + 1, vocabulary)
    return Task(
        model,
        text[:, :-1],
        text[:, 1:],
        batch,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        _momentum,
    )


#: keras-hub causal LM families: (backbone, causal LM, constructor options at a given
#: hidden size and head count). Grouped-query attention (half the key/value heads), rotary
#: embeddings, sliding windows and a mixture of experts where the family has them.
HUB_FAMILIES = {
    "gpt2": ("GPT2Backbone", "GPT2CausalLM", lambda hidden, heads: {
        "num_heads": heads, "max_sequence_length": 4096}),
    "llama": ("LlamaBackbone", "LlamaCausalLM", lambda hidden, heads: {
        "num_query_heads": heads, "num_key_value_heads": heads // 2}),
    "gemma": ("GemmaBackbone", "GemmaCausalLM", lambda hidden, heads: {
        "num_query_heads": heads, "num_key_value_heads": heads // 2,
        "head_dim": hidden // heads}),
    "mistral": ("MistralBackbone", "MistralCausalLM", lambda hidden, heads: {
        "num_query_heads": heads, "num_key_value_heads": heads // 2, "sliding_window": 64}),
    "qwen3": ("Qwen3Backbone", "Qwen3CausalLM", lambda hidden, heads: {
        "num_query_heads": heads, "num_key_value_heads": heads // 2,
        "head_dim": hidden // heads}),
    "mixtral": ("MixtralBackbone", "MixtralCausalLM", lambda hidden, heads: {
        "num_query_heads": heads, "num_key_value_heads": heads // 2,
        "num_experts": 4, "top_k": 2}),
}  # fmt: skip


def decoder_blocks(causal_lm: keras.Model) -> tuple[str, ...]:
    """The names of a keras-hub causal LM's decoder blocks: what per-block checkpoints keep
    (`msg.keras.layer_outputs` of them)."""
    return tuple(layer.name for layer in causal_lm.backbone.transformer_layers)


def causal_lm(
    family: str,
    layers_count: int = 4,
    hidden: int = 128,
    heads: int = 4,
    length: int = 256,
    batch: int = 4,
    batches: int = 4,
    vocabulary: int = 512,
    lora_rank: int | None = None,
) -> Task:
    """A keras-hub causal LM of `family` (`HUB_FAMILIES`), built from its constructors with
    `preprocessor=None`, trained on next tokens with AdamW; its backbone's LoRA enabled at
    `lora_rank` where given."""
    import keras_hub

    backbone_name, lm_name, options = HUB_FAMILIES[family]
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_name)(
        vocabulary_size=vocabulary,
        num_layers=layers_count,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
        **options(hidden, heads),
    )
    if lora_rank is not None:
        backbone.enable_lora(lora_rank)
    model = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    text = _tokens(1, batch * batches, length + 1, vocabulary)
    x = {"token_ids": text[:, :-1], "padding_mask": np.ones((batch * batches, length), bool)}
    return Task(
        model,
        x,
        text[:, 1:],
        batch,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        _adamw,
    )
