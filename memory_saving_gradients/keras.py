"""Checkpointed gradients for Keras 3 `model.fit`: the public names of the Keras integration.

    from memory_saving_gradients.keras import MemoryLog, enable, layer_outputs
    enable(model, checkpoints="memory")
    model.fit(x, y, callbacks=[MemoryLog()])

Also `msg.keras.enable` after `import memory_saving_gradients as msg`. What each does is in
`memory_saving_gradients.integrations.keras`, where they are made.
"""

from memory_saving_gradients.integrations.keras import enable
from memory_saving_gradients.integrations.keras_layers import LayerOutputs, layer_outputs
from memory_saving_gradients.integrations.keras_memory_log import MemoryLog

__all__ = ["LayerOutputs", "MemoryLog", "enable", "layer_outputs"]
