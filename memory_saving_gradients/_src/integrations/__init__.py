"""Integrations: the library where users already are, built on the public API.

The `GradientTape` drop-in (`tape`), Keras `fit` (`keras`), and patching `tf.gradients` and
optimizers (`patching`).
"""
