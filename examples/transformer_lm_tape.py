"""A GPT-style language model trained in a custom loop, gradients from the tape drop-in.

Inside a `tf.function` training step, `memory_saving_gradients.GradientTape` takes the place
of `tf.GradientTape`; nothing else changes. The model is a small decoder-only transformer:
token and position embeddings, then blocks of layer norm, causal multi-head self-attention,
layer norm and a GELU MLP, each added to its input. It learns synthetic sequences,
arithmetic progressions of steps 1 to 4 modulo the vocabulary size, in which every token
follows from the two before it. The script trains the same model from the same weights with
each tape, prints the losses and the peak memory of one training step, and how far the
checkpointed gradients are from TensorFlow's.

    python examples/transformer_lm_tape.py
    python examples/transformer_lm_tape.py --tiny    # a smaller model, as the tests run it
"""

import argparse
import dataclasses
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients.profiling import peak_memory

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Size:
    vocabulary: int
    length: int
    width: int
    heads: int
    blocks: int
    batch: int
    steps: int


FULL = Size(vocabulary=256, length=128, width=128, heads=4, blocks=8, batch=16, steps=60)
TINY = Size(vocabulary=64, length=64, width=64, heads=2, blocks=4, batch=16, steps=6)


class DecoderBlock(keras.layers.Layer):
    """Causal self-attention, then an MLP, each reading a layer norm of its input and added
    to it (the pre-norm block of GPT-2)."""

    def __init__(self, width: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.attention_norm = keras.layers.LayerNormalization()
        self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.mlp_norm = keras.layers.LayerNormalization()
        self.mlp_in = keras.layers.Dense(4 * width, activation="gelu")
        self.mlp_out = keras.layers.Dense(width)

    def call(self, h):
        a = self.attention_norm(h)
        h = h + self.attention(a, a, use_causal_mask=True)
        return h + self.mlp_out(self.mlp_in(self.mlp_norm(h)))


class TransformerLM(keras.Model):
    """Logits of each next token, given the tokens up to it."""

    def __init__(self, size: Size, **kwargs):
        super().__init__(**kwargs)
        self.token_embedding = keras.layers.Embedding(size.vocabulary, size.width)
        self.position_embedding = keras.layers.Embedding(size.length, size.width)
        self.decoder_blocks = [DecoderBlock(size.width, size.heads) for _ in range(size.blocks)]
        self.final_norm = keras.layers.LayerNormalization()
        self.logits = keras.layers.Dense(size.vocabulary)

    def call(self, tokens):
        positions = tf.range(tf.shape(tokens)[1])
        h = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.decoder_blocks:
            h = block(h)
        return self.logits(self.final_norm(h))


def progressions(size: Size, rng: np.random.Generator) -> np.ndarray:
    """A batch of token sequences start, start + step, start + 2 step, ... (mod vocabulary)."""
    start = rng.integers(0, size.vocabulary, (size.batch, 1))
    step = rng.integers(1, 5, (size.batch, 1))
    return ((start + step * np.arange(size.length + 1)) % size.vocabulary).astype("i4")


def loss_of(model, tokens):
    """The mean cross-entropy of each next token."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs, training=True)
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)
    )


def make_train_step(model, optimizer, tape_class):
    @tf.function
    def train_step(tokens):
        with tape_class() as tape:  # the one line: tf.GradientTape or msg.GradientTape
            loss = loss_of(model, tokens)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return train_step


def largest_gradient_difference(model, tokens) -> float:
    """The largest difference between a checkpointed and a plain gradient entry, relative to
    the largest plain entry. (Each gradient relative to its own largest entry would divide
    round-off by round-off for the attention keys' bias, whose gradient is zero: a bias
    added to every key leaves the softmax as it was.)"""

    @tf.function
    def both(tokens):
        gradients = []
        for tape_class in (tf.GradientTape, msg.GradientTape):
            with tape_class() as tape:
                loss = loss_of(model, tokens)
            dense = map(tf.convert_to_tensor, tape.gradient(loss, model.trainable_variables))
            gradients.append(list(dense))  # the embeddings' IndexedSlices, as dense tensors
        return gradients

    plain, checkpointed = both(tokens)
    return float(
        max(tf.reduce_max(tf.abs(c - p)) for p, c in zip(plain, checkpointed, strict=True))
        / max(tf.reduce_max(tf.abs(p)) for p in plain)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a smaller model, for a quick run")
    size = TINY if parser.parse_args().tiny else FULL
    print(
        f"{size.blocks} blocks of width {size.width}, {size.heads} heads; "
        f"batch {size.batch} x {size.length} tokens"
    )
    # TensorFlow's CPU allocator counts a fresh block it does not split whole, which would
    # inflate the peak of whichever step runs first: one large block freed first avoids it.
    grow = tf.zeros([1024 * MiB // 4])
    del grow
    peaks = {}
    for name, tape_class in [("plain", tf.GradientTape), ("checkpointed", msg.GradientTape)]:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        model = TransformerLM(size)
        step = make_train_step(model, keras.optimizers.Adam(3e-3), tape_class)
        losses = [float(step(progressions(size, rng))) for _ in range(size.steps)]
        batch = tf.constant(progressions(size, rng))
        peaks[name] = peak_memory(lambda step=step, batch=batch: float(step(batch))) / MiB
        print(
            f"{name:>12}: loss {losses[0]:.3f} at step 1, {losses[-1]:.3f} at step "
            f"{size.steps}, peak activation memory {peaks[name]:.0f} MiB"
        )
    print(f"checkpointed training step: {peaks['plain'] / peaks['checkpointed']:.1f}x less memory")
    difference = largest_gradient_difference(model, batch)
    print(f"checkpointed gradients differ from tf.gradients by {difference:.1e} at most")


if __name__ == "__main__":
    main()
