"""Function calls and the graph's function library: which ops call functions, and which op
types the functions they run hold."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import op_def_registry


def is_function_call(op: tf.Operation) -> bool:
    """Whether `op` calls a function of the graph's library (a nested `tf.function`, a Keras
    layer called as one, a `Defun`)."""
    return op.type in ("PartitionedCall", "StatefulPartitionedCall") or op.graph._is_function(
        op.type
    )


def called_op_types(op: tf.Operation) -> frozenset[str]:
    """The op types in the bodies of the functions `op` calls (a function call, the branches
    of an If, the body of a While) and of the functions those call, from the graph's library.
    """
    return frozenset().union(
        *(_body_op_types(name, op.graph) for name in _called_function_names(op.node_def, op.graph))
    )


#: Stateful op types that only read a variable's value.
_VARIABLE_READ_TYPES = frozenset(
    {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp"}
)


def stateful_through_variable_reads(op: tf.Operation) -> bool:
    """Whether `op` is stateful only because functions it runs (a while loop's body, a cond's
    branches, a nested tf.function) read variables: the only stateful ops in them are variable
    reads and ops running further functions."""
    called = called_op_types(op)
    if not called:
        return False
    for op_type in called - _VARIABLE_READ_TYPES:
        op_def = op_def_registry.get(op_type)  # None for a library function called by name
        if op_def is not None and op_def.is_stateful and not _runs_functions(op_def):
            return False
    return True


def _runs_functions(op_def) -> bool:
    """Whether ops of `op_def` run functions (their attributes name them), whose bodies decide
    whether they are stateful (While, If, Case, StatefulPartitionedCall)."""
    return any(attr.type in ("func", "list(func)") for attr in op_def.attr)


#: Op types in each library function's body and callees, by name. A name stands for one body:
#: tf.function names are unique in a process, Defun names hash their definition. At most
#: `FUNCTIONS_KEPT` names are kept (each trace makes new ones); the oldest goes first.
_BODY_OP_TYPES: dict[str, frozenset[str]] = {}
FUNCTIONS_KEPT = 4096


def _body_op_types(name: str, graph: tf.Graph) -> frozenset[str]:
    if name not in _BODY_OP_TYPES:
        if len(_BODY_OP_TYPES) >= FUNCTIONS_KEPT:
            del _BODY_OP_TYPES[next(iter(_BODY_OP_TYPES))]
        _BODY_OP_TYPES[name] = frozenset()  # a function calling itself adds nothing new
        function = _library_function(graph, name)
        nodes = [] if function is None else function.definition.node_def
        _BODY_OP_TYPES[name] = frozenset(node.op for node in nodes).union(
            *(
                _body_op_types(callee, graph)
                for node in nodes
                for callee in _called_function_names(node, graph)
            )
        )
    return _BODY_OP_TYPES[name]


def _called_function_names(node_def, graph: tf.Graph) -> list[str]:
    """Names of the functions a NodeDef calls: its function attributes, or its op type for a
    call of a library function by name (`Defun`)."""
    names = [node_def.op] if _library_function(graph, node_def.op) is not None else []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


def _library_function(graph: tf.Graph, name: str):
    """Library function `name` of `graph` or of a graph it is nested in, or None."""
    while graph is not None:
        function = graph._get_function(name)
        if function is not None:
            return function
        graph = getattr(graph, "outer_graph", None)
    return None
