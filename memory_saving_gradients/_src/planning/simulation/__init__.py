"""The memory a training step needs, simulated: bytes alive as the executor runs it.

A step is simulated op by op, forward in the view's topological order, then backward the
way TensorFlow's executor runs a backward pass the gates order: with one inter-op thread (or
under XLA, whose schedule runs one op at a time) in reverse, with more the gradients of
independent branches side by side, each holding what it made and read until it finishes
(`executor`), and the kernels of one gradient apart (a convolution's input gradient goes on
to the ops before it while its filter gradient still runs). An op's outputs are allocated
while its inputs are still alive; then every buffer no tensor needs any more is freed.
Tensors share buffers where TensorFlow's kernels share them: reshapes and identities alias
their input, element-wise kernels write into an input buffer nothing else needs
(`kernels.REUSES_INPUT_BUFFER`). Backprop keeps what each gradient reads (`costs.OpCost`) until
that gradient has run. Each op's gradient is simulated as the ops of its registered gradient
function (`gradient_uses.GradientUse`) running on the buffers they read, so a gradient passed on
unchanged (an Add's) aliases the arriving one, and a temporary lives until its last reader.
The gradient parts of one tensor are summed once all have arrived (an AddN runs once its
inputs exist). Gradients of xs live to the end of the step where the view says they are
held (fetched, returned, or checked all together before an optimizer applies any); otherwise
each is freed once the last op reading its x is differentiated, as an update in the same
step consumes it: SGD computes its learning rate times gradient in the gradient's buffer,
and, as checkpointed backprop passes a gradient on only once every op reading its variable
has run (NOTE [updates after reads] in rewriting/backprop.py), updates the variable in place. Plain
`tf.gradients` passes it on at once, so the update may run while the variable is still read,
and copies it: one temporary of its size. Optimizers' own temporaries (Adam's) are not
counted.
What a gradient computes from constants alone (the seed of the loss, static shapes) is folded
ahead of the step, as graph optimizers do. A kernel's own buffers (`kernels.working_bytes`) are
alive while it runs, beside its inputs and outputs; with more than one inter-op thread,
those of one gradient's kernels together (the two products of a MatMul's gradient are ready
at once, and the executor runs them side by side; measured, the largest as many as there are
threads: `measured.OpMeasurement.gradient_scratch_at_once`).

With checkpoints, the forward pass keeps only the boundaries and what the last segment's
gradients read; each step then recomputes its segments into new buffers (with nested
checkpoints, keeping only those and recomputing the inner segments once more), differentiates
them, and frees the boundaries no later step reads (`peaks`). Under XLA a step also copies
what its matmuls and convolutions read through its gate (`Simulator.gate_copies`). A
recomputed op whose outputs nothing reads is not run: the executor prunes it. Ops computed
from variables alone (a kernel's half-precision copy) run as their reader is about to, as the
rewrite makes them wait; in the forward pass of a tf.compat.v1 graph, which it leaves as
built, as the step starts (NOTE [weight ops wait for their readers] in analysis/view.py).

What this leaves out, measured against TensorFlow (benchmarks/cost_model.py,
benchmarks/measured_costs.py): the executor times ops to choose which of the ready ones
wait, so it may run a gradient's ops that read only forward tensors before the gradient
arrives, or leave a weight gradient queued, and hold their tensors meanwhile; recomputation
runs one op at a time, before the step's gradients (run beside them on two threads, as the
executor may, it changed no predicted peak of MobileNetV2 or ResNet50); graph optimizers
rewrite gradients (by rules that depend on op names, which the rewrite keeps in the order
`tf.gradients` has: NOTE [names of recomputed ops] in rewriting/backprop.py); and
TensorFlow's allocator hands a request a free block of up to twice its size whole (the
command's transformer under MemoryBudget(0.5): an 8 MiB attention score took a 15 MiB block).

Peaks count bytes above what is resident before the step: variables, constants, inputs.
"""

from memory_saving_gradients._src.planning.simulation.peaks import checkpointed_peak, plain_peak

__all__ = ["checkpointed_peak", "plain_peak"]
