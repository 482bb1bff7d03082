"""What plans may save inside segments (selective recomputation), and what 'speed' keeps.

Each tensor is weighed by what it costs to remake per byte kept: the outputs of matmuls and
convolutions with weights cost the most; products of two activations (attention's scores)
cost less as their operands are small. 'speed' saves what costs at least as much as the
cheapest product with a weight, moved up to the operands of the products it recomputes;
budgets and 'balanced' search sets of such tensors (`saveable_sets`). `policies` turns them
into plans, `search` finds the cuts around them.
"""

from __future__ import annotations

import math

import tensorflow as tf

from memory_saving_gradients._src import _tf
from memory_saving_gradients._src.analysis import kernels
from memory_saving_gradients._src.analysis.view import ForwardView
from memory_saving_gradients._src.planning import tunables
from memory_saving_gradients._src.planning.schedule import saveable, spared

#: Op types whose outputs the 'speed' strategy keeps: recomputing them costs the most.
EXPENSIVE_OP_TYPES = kernels.CONTRACTIONS | {
    "Conv", "Conv2DBackpropInput", "Conv3DBackpropInputV2", "SparseMatMul"
}  # fmt: skip


def _saveable(view: ForwardView) -> list[tf.Tensor]:
    """The tensors plans may save inside segments, densest first: compute to remake them
    (measured seconds, or FLOPs) per byte kept. Only tensors recomputed ops read count, and
    not those whose gradient reads them (a ReLU's, a softmax's), whose own compute is little:
    they are saved where that spares a product (`sparing_contractions`)."""
    candidates = [
        op.outputs[0]
        for op in view.ops
        if op.outputs
        and saveable(view, op.outputs[0])
        and not view.costs[op].saved_outputs
        and view.bytes(op.outputs[0])
        and any(reader in view.recomputable for reader in view.consumers(op.outputs[0]))
    ]
    return sorted(candidates, key=lambda t: -view.costs[t.op].compute / view.bytes(t))


def as_dense_as_contractions(
    view: ForwardView, candidates: list[tf.Tensor] | None = None
) -> list[tf.Tensor]:
    """What 'speed' saves: every saveable tensor costing at least as many FLOPs to remake per
    byte as the cheapest output of a matmul or convolution with weights does (those outputs,
    products of activations as dense, and the statistics of normalisations: a full pass
    over a tensor for a few bytes). FLOPs even where kernel
    times were measured: graph optimizers fuse a convolution with what follows it, and the
    fused kernel's time is charged to the last op it absorbed. `candidates`: `_saveable`'s,
    where the caller has them."""
    candidates = _saveable(view) if candidates is None else candidates
    floor = _density_floor(view)
    return [t for t in candidates if _density(view, t.op) >= floor]


def speed_saved(view: ForwardView, candidates: list[tf.Tensor] | None = None) -> list[tf.Tensor]:
    """What 'speed' saves inside segments: `as_dense_as_contractions`, moved up to the
    operands of the products of activations it recomputes (`_up_to_products`)."""
    return _up_to_products(view, as_dense_as_contractions(view, candidates))


def _up_to_products(view: ForwardView, saved: list[tf.Tensor]) -> list[tf.Tensor]:
    """`saved` with tensors moved forward to the operands of the products of activations
    it leaves recomputed, where those are no larger: attention's queries and keys as its
    query-key product reads them, after the bias, the rotary embedding and the transpose
    into heads, rather than the projections' outputs. As Megatron-LM keeps attention's
    inputs, the recomputation then starts at the product: the ops between, cheap in FLOPs
    but each a pass over memory, are not run again. An operand larger than what it is made
    from (keys repeated for grouped-query attention) is moved no further than the last
    tensor of the same size before it, and a saved tensor is given up only where every op
    reading it is spared (`schedule.spared`)."""
    kept = {t.ref() for t in saved}
    recomputable = frozenset(view.recomputable)
    rerun = recomputable - {t.op for t in saved}
    moved: dict[object, tuple[tf.Tensor, set]] = {}
    for op in view.ops:
        if op not in rerun or not is_contraction(op):
            continue
        for operand in op.inputs:
            found = _moved_operand(view, operand, kept, rerun, recomputable)
            if found is not None:
                moved.setdefault(found[0].ref(), found)
    while True:
        spares = set().union(*(ops for _, ops in moved.values()))
        given_up = {t.ref() for t in saved if _read_only_by(view, t, spares)}
        unfed = [
            ref
            for ref, (tensor, ops) in moved.items()
            if not any(t.ref() in given_up for op in ops for t in op.inputs)
        ]
        if not unfed:
            break
        for ref in unfed:
            del moved[ref]
    if not given_up:
        return saved
    return [t for t in saved if t.ref() not in given_up] + [t for t, _ in moved.values()]


def _moved_operand(
    view: ForwardView,
    operand: tf.Tensor,
    kept: set,
    rerun: frozenset[tf.Operation],
    recomputable: frozenset[tf.Operation],
) -> tuple[tf.Tensor, set] | None:
    """The tensor on the way from `kept` tensors to `operand` (a product's, recomputed) to
    save in their place, and the ops saving it spares: the latest no larger than the kept
    tensors it is made from. None where the way holds a product itself, or no such tensor."""
    if operand.ref() in kept or operand.op not in rerun or not saveable(view, operand):
        return None
    ops, frontier = spared(view, operand, rerun, recomputable, lambda t: False)
    fed = sum(view.bytes(t) for t in frontier if t.ref() in kept)
    if not fed or any(is_contraction(op) for op in ops):
        return None
    for op in ops:  # from the operand back
        tensor = op.outputs[0] if len(op.outputs) == 1 else None
        if tensor is not None and view.bytes(tensor) <= fed and saveable(view, tensor):
            ops, _ = spared(view, tensor, rerun, recomputable, lambda t: False)
            return tensor, set(ops)
    return None


def _read_only_by(view: ForwardView, tensor: tf.Tensor, ops: set[tf.Operation]) -> bool:
    """Whether `ops` alone read `tensor`, and none of their gradients does."""
    readers = view.consumers(tensor)
    return bool(readers) and all(
        reader in ops
        and not any(reader.inputs[i] is tensor for i in view.costs[reader].saved_inputs)
        for reader in readers
    )


def saveable_sets(view: ForwardView) -> list[list[tf.Tensor]]:
    """Sets of tensors a budget's plans may save inside segments: what 'speed' saves; its
    earliest tensors up to ever larger shares of its bytes (`tunables.SAVED_PREFIXES`: a plan
    within a budget recomputes the forward pass up to some point and keeps the rest as plain
    backprop does, so saving there is what spares the recomputation, while saving beyond that
    point would only add to the peak); the densest saveable tensors up to ever larger
    shares of their bytes (`tunables.SAVED_SHARES`; with measured costs, the normalisations and
    activations that take a CPU longer per byte than the convolutions beside them); and what
    'speed' saves with the earliest of the tensors whose saving spares a product it
    recomputes, up to the same shares of their bytes and all of them (Megatron-LM's
    selective recomputation with the softmax of the first blocks kept)."""
    candidates = _saveable(view)
    speed_set = speed_saved(view, candidates)
    in_forward_order = sorted(speed_set, key=lambda t: view.position[t.op])
    sets = [speed_set]
    sets += [_leading(view, in_forward_order, share) for share in tunables.SAVED_PREFIXES]
    sets += [_leading(view, candidates, share) for share in tunables.SAVED_SHARES]
    sparing = sparing_contractions(view, speed_set)
    sets += [
        [*speed_set, *_leading(view, sparing, share)] for share in (*tunables.SAVED_PREFIXES, 1.0)
    ]
    distinct: dict[frozenset, list[tf.Tensor]] = {}
    for tensors in sets:
        if tensors:
            distinct.setdefault(frozenset(t.ref() for t in tensors), tensors)
    return list(distinct.values())


def sparing_contractions(view: ForwardView, speed_set: list[tf.Tensor]) -> list[tf.Tensor]:
    """Tensors whose saving beside `speed_set` spares a product 'speed' recomputes (not one
    its saved tensors spare already), in forward order: the softmax after attention's
    query-key product (saving it spares the product, the transpose and the softmax:
    `schedule.spared`), not the product itself where a later one of them spares it too."""
    kept = {t.ref() for t in speed_set}
    recomputable = frozenset(view.recomputable)
    rerun = recomputable - {t.op for t in speed_set}
    rerun -= {
        op
        for t in speed_set
        if saveable(view, t)
        for op in spared(view, t, rerun, recomputable, lambda t: False)[0]
    }
    spares = {}
    for op in view.ops:
        if op not in rerun or not op.outputs or op.outputs[0].ref() in kept:
            continue
        if not saveable(view, op.outputs[0]):
            continue
        ops, _ = spared(view, op.outputs[0], rerun, recomputable, lambda t: False)
        if any(is_contraction(each) for each in ops):
            spares[op] = ops
    spared_by_others = {each for ops in spares.values() for each in ops[1:]}
    return [op.outputs[0] for op in spares if op not in spared_by_others]


def _leading(view: ForwardView, tensors: list[tf.Tensor], share: float) -> list[tf.Tensor]:
    """The first of `tensors` whose bytes together are at most `share` of all of theirs."""
    total = sum(view.bytes(t) for t in tensors)
    chosen, size = [], 0
    for t in tensors:
        if size + view.bytes(t) > share * total:
            break
        chosen.append(t)
        size += view.bytes(t)
    return chosen


def is_contraction(op: tf.Operation) -> bool:
    """A matmul or convolution, or a function call running one."""
    return op.type in EXPENSIVE_OP_TYPES or not EXPENSIVE_OP_TYPES.isdisjoint(
        _tf.called_op_types(op)
    )


def _density(view: ForwardView, op: tf.Operation) -> float:
    """FLOPs to remake `op`'s first output, per byte of it."""
    return view.costs[op].flops / max(view.bytes(op.outputs[0]), 1)


def _with_weights(view: ForwardView, op: tf.Operation) -> bool:
    """Whether `op` reads a weight (`ForwardView.is_weight`): a projection, not a product of
    two activations."""
    return any(view.is_weight(t) for t in op.inputs)


def _density_floor(view: ForwardView) -> float:
    """The least FLOPs per byte of an output of a matmul or convolution with weights ('speed'
    saves what costs as much to remake), or of any contraction where none reads weights."""
    contractions = [op for op in view.ops if op.outputs and is_contraction(op)]
    weighted = [op for op in contractions if _with_weights(view, op)] or contractions
    return min((_density(view, op) for op in weighted), default=math.inf)


def expensive_ops(view: ForwardView) -> list[tf.Operation]:
    """The contractions 'speed' keeps: those with weights, function calls running one, and
    products of activations as dense as the cheapest with weights."""
    floor = _density_floor(view)
    return [
        op
        for op in view.ops
        if op.outputs
        and is_contraction(op)
        and (
            op.type not in EXPENSIVE_OP_TYPES
            or _with_weights(view, op)
            or _density(view, op) >= floor
        )
    ]
