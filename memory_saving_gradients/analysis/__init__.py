"""Analysis: what the forward graph between xs and ys is, and what each of its ops costs.

The first stage of the pipeline. The arguments are checked (`arguments`), graph queries
(`queries`) walk the graph, `view` holds the forward graph as checkpointing sees it, and
`costs` what each op allocates, computes and keeps for its gradient. Nothing here decides what
to keep or builds an op.
"""
