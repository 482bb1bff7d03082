"""The `memory-saving-gradients` command (`python -m memory_saving_gradients`).

`demo` measures plain and checkpointed gradients on a deep chain, `bench` does the same for a
chosen model against TensorFlow's own recomputation, and `explain` prints what each strategy
would keep. `main` parses and checks the options; `measure` runs and measures training steps
of the models of `memory_saving_gradients._src.models.command`, `report` writes tables, CSV files
and plots.
"""
