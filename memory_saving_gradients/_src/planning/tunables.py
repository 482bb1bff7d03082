"""Every knob of the checkpoint search, in one place.

`cut_search` (the cut search: a dynamic programme over an order of ops, nested) and `search`
(the bisections over it for budgets and the least peak) both read them; neither holds any of
its own. Each says what it trades.
"""

# The cut search (`cut_search`).

#: Bisection steps on the peak: the result is within 2**-30 of the best peak the model allows.
BISECTION_STEPS = 30
#: Among cuts of equal size, prefer those made of tensors backprop would not hold anyway (a
#: matmul output read only by a tanh): they die as soon as the recomputation past them starts,
#: while a held one (the tanh output) lives on until its readers' gradients are done.
TIE_BREAK = -1e-3
#: How many tie breaks a cut pays back to keep a tensor read only by a BiasAdd (it earns one
#: where backprop does not hold the tensor), so that of equal cuts it takes the BiasAdd's
#: output: a cut before the BiasAdd splits what oneDNN fuses, the product with its bias add,
#: and the filter gradient with the bias gradient. TensorFlow's CPU kernel for a
#: half-precision bias gradient alone sums in half precision, far from the fused kernel's
#: float32 sum (tests/test_parity.py, bias gradients under mixed_bfloat16).
FUSION_SPLIT = 2
#: Levels of recomputation nested inside the top level, at most.
MAX_NESTING = 3
#: Larger top-level peaks tried for nested plans, as multiples of the target.
NESTING_SCALES = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)

# The search for budgets and for the least peak (`search`).

#: Plans simulated while looking for the one that fits a budget, at most.
BUDGET_BISECTIONS = 6
#: Model peaks tried between one level's least and the least any cuts allow, bisected.
LEAST_PEAK_BISECTIONS = 6
#: Model peaks also tried at these shares of the way from the least any cuts allow to one
#: level's least: bisection tries shares of a half and below, and nested plans for larger
#: model peaks, nesting less, may simulate lower and recompute less (tests/test_plans.py, six
#: residual blocks).
LEAST_PEAK_SHARES = (0.625, 0.75, 0.875)
#: One level's cuts are also tried for these multiples of its least model peak: the
#: simulated peak does not rise steadily with the model's (an Inception block's is lower
#: at 1.5 times the least than at the least).
ONE_LEVEL_SCALES = (1.1, 1.25, 1.5)
#: 'memory' takes the plan recomputing least among those whose predicted peak is within this
#: fraction of the least: a level of nesting costs about one more forward pass.
NESTING_GAIN = 0.03

# Selective recomputation (`policies`: what budgets may save inside segments).

#: Shares of the bytes 'speed' saves that budgets also try saving alone, earliest in the
#: forward pass first: each is one more set of plans to search (on a residual CNN a budget's
#: plan recomputing least saves the first half: saving all or nothing recomputes more).
SAVED_PREFIXES = (0.25, 0.5, 0.75)
#: Shares of the saveable tensors' bytes that budgets try to save, densest compute per byte
#: first: each share is one more set of plans to search, the plan recomputing least winning.
SAVED_SHARES = (0.25, 0.5, 0.75)

# Plans' first segment (`search.as_it_ran_first`).

#: The largest share of a plan's predicted peak that the segment backprop reaches first may
#: make when it is recomputed for it still to be differentiated as it ran instead. The
#: simulator has the same tensors alive either way, but at the turn from the forward pass
#: to backprop the executor's order is where it is least sure: given up for the last block of
#: the encoder of `fit --model transformer --grow length` (attention matrices), 'speed' fit
#: 432 tokens in 128 MiB where it fit 465; the softmax cross-entropy of a loss is far below it.
AS_IT_RAN_SHARE = 0.125
