"""The implementation: private, its names may change without notice. The public modules
(`memory_saving_gradients`, `.keras`, `.profiling`) re-export what users call; the layout and
the order its layers import in are in docs/internals/layout.md."""
