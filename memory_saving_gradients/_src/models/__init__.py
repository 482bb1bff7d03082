"""The models this project measures and tests on, built the same way wherever they are used.

- `graphs`: small models of raw TensorFlow ops, buildable in a Session graph and a tf.function.
- `zoo`: real Keras architectures (ResNet, DenseNet, MobileNetV2, Inception, U-Net, a
  transformer, MLPs, tf.function layers, a custom gradient) at the sizes of a `Scale`.
- `command`: the kinds of model the `memory-saving-gradients` command measures (a tanh
  chain, ResNet, DenseNet, U-Net, transformer, keras.applications), any depth and `Shape`,
  their blocks passed through a `wrap` for the baselines.
- `transformers`: transformers trained with Keras `fit` (an encoder, a causal decoder, and
  keras-hub causal LMs of each family built from their constructors).
- `common`: what more than one catalogue builds the same way (weights, batches, a loss).

Each module imports TensorFlow; this one imports none, so that importing the package stays
cheap.
"""
