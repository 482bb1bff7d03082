"""Planning: what to keep, and what that is predicted to cost.

The public policies and the budget search choose checkpoints over the cut search; the
schedule orders a plan's steps as a tree, which the simulator walks to predict the peak and
the plan reports. Built on `analysis`; nothing here edits a graph.
"""
