"""The memory a training step needs, simulated: bytes alive as the executor runs it.

A step is simulated op by op: forward in the view's topological order, then backward as
TensorFlow's executor runs the backward pass the gates order (in reverse with one inter-op
thread or under XLA; with more, independent branches' gradients side by side: `executor`).
An op's outputs are allocated while its inputs are alive, then every buffer nothing needs
any more is freed; buffers are shared where kernels share them (aliases, element-wise reuse).
Each gradient runs as the ops of its registered gradient function (`gradient_uses`), holding
what it reads (`costs`); gradients of xs live to the end of the step where they are held,
else until their variable's last reader is differentiated. With checkpoints, the forward
pass keeps the boundaries and each step recomputes its segments, nested where the plan nests
(`peaks`). Peaks count bytes above what is resident before the step.

What this counts and what it leaves out, with the mechanisms behind each, is
docs/internals/memory-model.md; `bench --suite predictions` (`cli/suites/predictions.py`) sets
predictions against measured peaks.
"""

from memory_saving_gradients._src.planning.simulation.peaks import checkpointed_peak, plain_peak

__all__ = ["checkpointed_peak", "plain_peak"]
