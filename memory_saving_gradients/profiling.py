"""Measure a step: how a user sees that checkpointing works.

    from memory_saving_gradients.profiling import interleaved_step_times, peak_memory
    peak_memory(step)                                      # bytes the step needed at its peak
    interleaved_step_times({"plain": plain, "checkpointed": step})  # seconds, taken in turns
    step_time_ratios({"plain": plain, "checkpointed": step}, "plain")  # over plain's, per turn
    turn_ratios({name: t[1:] for name, t in times.items()}, "plain")  # times taken, less warm-up

`measure_costs(step)` profiles a plain step kernel by kernel, to plan from (also
`msg.measure_costs`). Each is made in `memory_saving_gradients._src.profiling`.
"""

from memory_saving_gradients._src.profiling import (
    TimeRatio,
    interleaved_step_times,
    measure_costs,
    peak_memory,
    step_time_ratios,
    turn_ratios,
)

__all__ = [
    "TimeRatio",
    "interleaved_step_times",
    "measure_costs",
    "peak_memory",
    "step_time_ratios",
    "turn_ratios",
]
