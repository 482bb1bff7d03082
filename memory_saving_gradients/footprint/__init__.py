"""The memory a training step needs, simulated (`peaks`): the peaks plans predict."""

from memory_saving_gradients.footprint.peaks import checkpointed_peak, plain_peak

__all__ = ["checkpointed_peak", "plain_peak"]
