"""Measure a step: how a user sees that checkpointing works.

    from memory_saving_gradients.profiling import interleaved_step_times, peak_memory
    peak_memory(step)                                      # bytes the step needed at its peak
    interleaved_step_times({"plain": plain, "checkpointed": step})  # seconds, taken in turns

`measure_costs(step)` profiles a plain step kernel by kernel, to plan from (also
`msg.measure_costs`). Each is made in `memory_saving_gradients._src.profiling`.
"""

from memory_saving_gradients._src.profiling import (
    interleaved_step_times,
    measure_costs,
    peak_memory,
)

__all__ = ["interleaved_step_times", "measure_costs", "peak_memory"]
