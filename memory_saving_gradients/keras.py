"""Checkpointed gradients for Keras 3 `model.fit`: the public names of the Keras integration.

    from memory_saving_gradients.keras import MemoryLog, enable, layer_outputs
    enable(model, checkpoints="memory")
    model.fit(x, y, callbacks=[MemoryLog()])

`largest(build, limit_bytes)` finds the largest batch or sequence of a model that trains in
that much memory, plain and checkpointed. Also `msg.keras.enable` after
`import memory_saving_gradients as msg`. Each is made in
`memory_saving_gradients._src.integrations`.
"""

from memory_saving_gradients._src.integrations.keras import enable
from memory_saving_gradients._src.integrations.keras_layers import LayerOutputs, layer_outputs
from memory_saving_gradients._src.integrations.keras_memory_log import MemoryLog
from memory_saving_gradients._src.integrations.keras_sizing import Largest, largest

__all__ = ["Largest", "LayerOutputs", "MemoryLog", "enable", "largest", "layer_outputs"]
