"""Every TensorFlow private API the library relies on, each behind one small function.

TensorFlow 2 ships no graph editor, so copying ops, adding control inputs and calling the real
gradient implementation go through private methods of `tf.Graph` and `tf.Operation`. Keeping
them here means a TensorFlow release that changes one breaks one function, and
`tests/test_tf_compat.py` names it. The functions are grouped by what they reach into
(`graph_editing`, `functions`, `gradients`, `runtime`) and all named here, where the rest of
the package calls them.
"""

from memory_saving_gradients._src._tf.functions import (
    called_op_types,
    is_function_call,
    stateful_through_variable_reads,
)
from memory_saving_gradients._src._tf.gradients import (
    CONTROL_FLOW_TYPES,
    GRADIENT_ENTRY_POINTS,
    EntryPoint,
    GradientAside,
    gradient_aside,
    gradient_entry_points,
    is_differentiable,
    sum_gradients,
    tensorflow_gradients,
    zero_gradient,
)
from memory_saving_gradients._src._tf.graph_editing import (
    add_control_inputs,
    copy_handle_data,
    copy_op,
    copying,
    creation_index,
    differentiated_as,
    outside_caller_scopes,
    replace_input,
)
from memory_saving_gradients._src._tf.runtime import (
    building_in_v1_control_flow,
    compiled_by_xla,
    in_v1_control_flow,
    is_resource_variable,
    is_stateful,
    onednn_enabled,
    read_profile,
    tape_recording,
)

__all__ = [
    "CONTROL_FLOW_TYPES",
    "GRADIENT_ENTRY_POINTS",
    "EntryPoint",
    "GradientAside",
    "add_control_inputs",
    "building_in_v1_control_flow",
    "called_op_types",
    "compiled_by_xla",
    "copy_handle_data",
    "copy_op",
    "copying",
    "creation_index",
    "differentiated_as",
    "gradient_aside",
    "gradient_entry_points",
    "in_v1_control_flow",
    "is_differentiable",
    "is_function_call",
    "is_resource_variable",
    "is_stateful",
    "onednn_enabled",
    "outside_caller_scopes",
    "read_profile",
    "replace_input",
    "stateful_through_variable_reads",
    "sum_gradients",
    "tape_recording",
    "tensorflow_gradients",
    "zero_gradient",
]
