"""What TensorFlow's runtime is doing as ops are built and run: tapes recording, TF1 control-flow
frames, XLA compilation, oneDNN kernels, and the profiles it writes."""

from __future__ import annotations

import glob
import os

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import control_flow_util, resource_variable_ops
from tensorflow.python.util import _pywrap_util_port


def tape_recording() -> bool:
    """Whether a GradientTape or ForwardAccumulator records the ops being built now: each
    records an op as its Python wrapper makes it, so it never sees the ops `copy_op` makes."""
    return record.could_possibly_record()


def is_stateful(op: tf.Operation) -> bool:
    """Whether running `op` twice may give different results or side effects."""
    return op._is_stateful


def is_resource_variable(value: object) -> bool:
    """Whether `value` is differentiated through its resource handle, as `tf.GradientTape` does:
    `tf.Variable`, distributed variables, Keras 3 variables and other variable-like objects."""
    return resource_variable_ops.is_resource_variable(value)


def in_v1_control_flow(op: tf.Operation) -> bool:
    """Whether `op` lives inside a TF1 while loop or cond (Switch/Merge frames). The context
    XLA compilation sets (`get_concrete_function` of a `jit_compile=True` function traces its
    ops inside one) is no frame."""
    return _in_frame(op._get_control_flow_context())


def building_in_v1_control_flow(graph: tf.Graph) -> bool:
    """Whether ops built now in `graph` go inside a TF1 while loop or cond: the caller is
    building a loop body or branch (as `tf.compat.v1.hessians` builds one gradient call per
    iteration)."""
    return _in_frame(graph._get_control_flow_context())


def _in_frame(context) -> bool:
    while context is not None:
        if context.IsWhileContext() or context.IsCondContext():
            return True
        context = context.outer_context
    return False


def onednn_enabled() -> bool:
    """Whether TensorFlow runs oneDNN's CPU kernels (the default on x86; TF_ENABLE_ONEDNN_OPTS=0
    turns them off)."""
    return bool(_pywrap_util_port.IsMklEnabled())


def compiled_by_xla(graph: tf.Graph) -> bool:
    """Whether `graph` (or a graph it is nested in) is being built for XLA compilation, as in
    `tf.function(jit_compile=True)`."""
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def read_profile(directory: str):
    """The `XSpace` (TensorFlow's profile protocol buffer) that `tf.profiler.experimental`
    wrote under `directory`: TensorFlow has no public reader of its own profiles."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"The profiler wrote no profile under {directory}.")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as file:
        space.ParseFromString(file.read())
    return space
