"""Analysis: what the forward graph between xs and ys is, and what each of its ops costs.

The first stage of the pipeline. The arguments are checked (`arguments`), graph queries
(`queries`) walk the graph, `view` holds the forward graph as checkpointing sees it, `kernels`
says what TensorFlow's kernels allocate, `gradient_uses` what each op's gradient function reads
and runs, and `costs` what each op allocates, computes and keeps for its gradient (`measured`
where a step was profiled). Nothing here decides what to keep or builds an op.
"""
