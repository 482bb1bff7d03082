"""Rewriting: the checkpointed backward pass, built from a plan's schedule.

`backprop` runs the schedule step by step with TensorFlow's own gradient calls, `editor`
copies the ops a step recomputes, `gates` hold each step back until backprop reaches it,
`ordering` orders the weight gradients each gradient call made, and `enclosing` takes
gradients across the graphs enclosing a function body.
"""
