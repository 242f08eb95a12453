"""Inference folding: a per-channel scale and shift after a convolution or
matrix product folds into its weights.

An inference batch norm after a convolution reaches the core graph as
elementwise adds, subs, muls and divs by per-channel values (torch's
decomposition of ``_native_batch_norm_legit_no_training``, flax's
``BatchNorm(use_running_average=True)``, TF's ``FusedBatchNormV3`` with
``is_training`` off): ``conv(x, w) * s + t`` per output channel, which is
``conv(x, w * s) + t``. The pass rewrites the chain so: the kernel is scaled
(one pass over the weights, not one over the activations per op) and one add
is left to fuse into what follows. Where the weights and the statistics are
constants (closed-over parameters), the folded kernel is computed here, at
compile time; otherwise (torch.compile passes parameters as inputs) it is a
weight-sized graph computation of each call.

Only values used once are rewritten: in training the batch's statistics
read the convolution's result, which then has other users, and nothing
folds.
"""
from __future__ import annotations

import collections
from typing import Callable, NamedTuple

import numpy as np

from . import sizes as sz
from .dtypes import DataType
from .graph import BINARY_OPS, UNARY_OPS, Graph, Node

_SAME_VALUES = ("broadcast_in_dim", "reshape")  # a scalar's value through them is its own


def fold_scales(graph: Graph, each_call: bool = True) -> tuple[Graph, int]:
    """A copy of graph with each contraction's per-channel affine epilogue
    folded into its weights, and the number of contractions folded; with
    each_call off, only where the folded weights are constants."""
    order = graph.nodes()
    users = collections.Counter([i.id for n in order for i in n.inputs] + [o.id for o in graph.outputs])
    user_of = {i.id: n for n in order for i in n.inputs}
    ends: dict[int, tuple[Node, list[Node]]] = {}  # a chain's last node -> (its contraction, the chain)
    for n in order:
        axes = _axes(n)
        chain, cur, scales = [], n, False
        while axes is not None and users[cur.id] == 1 and cur.id in user_of:
            step = _step(user_of[cur.id], cur, n.shape, axes[0])
            if step is None:
                break
            cur = user_of[cur.id]
            chain.append(cur)
            scales = scales or _STEPS[step[0]].scales and not _one(step[1])
        if scales:
            ends[cur.id] = (n, chain)
    if not ends:
        return graph, 0
    count = 0

    def fold(old: Node, node: Node, new: dict[int, Node]) -> Node:
        nonlocal count
        if old.id not in ends:
            return node
        n, chain = ends[old.id]
        n, chain = new[n.id], [new[u.id] for u in chain]
        axes = _axes(n)
        steps = [_step(u, y, n.shape, axes[0]) for u, y in zip(chain, [n] + chain)]
        folded = _folded(n, axes, steps, each_call)
        count += folded is not None
        return node if folded is None else folded
    g = graph.rewritten(fold)
    return g, count


def _axes(n: Node) -> tuple[int, int] | None:
    """(the result's channel dim, the weight's dim that makes it) of a float
    convolution or product whose second operand is a weight (an input or a
    constant, read through transposes) with one free dim; None for others."""
    if n.dtype not in (DataType.Float, DataType.Double) or n.op not in _CHANNEL_AXES:
        return None
    w = n.inputs[1]
    while w.is_index_transpose:
        w = w.inputs[0]
    if not w.is_source:
        return None
    return _CHANNEL_AXES[n.op](n)


def _conv_axes(n: Node) -> tuple[int, int]:
    return n.attrs["layout"].index("C"), n.attrs["kernel_layout"].index("O")


def _dot_axes(n: Node) -> tuple[int, int] | None:
    at = n.attrs
    rf = [d for d in range(n.inputs[1].rank) if d not in at["rc"] and d not in at["rb"]]
    return (n.rank - 1, rf[0]) if len(rf) == 1 else None


_CHANNEL_AXES = {"conv": _conv_axes, "dot_general": _dot_axes}


def _step(u: Node, y: Node, shape, axis: int):
    """(op, per-channel operand as a [C] node, whether y is u's left operand)
    where u applies a per-channel add, sub, mul or div to y; None otherwise."""
    if u.op not in _STEPS or u.dtype != y.dtype or u.shape != shape:
        return None
    left = u.inputs[0] is y
    other = u.inputs[1] if left else u.inputs[0]
    if other is y or not (left or _STEPS[u.op].either_side):
        return None
    p = _per_channel(other, axis)
    return None if p is None else (u.op, p, left)


def _per_channel(p: Node, axis: int) -> Node | None:
    """p (broadcast along every dim but axis) as a [C] node, C its extent along axis."""
    if p.op != "broadcast_in_dim" or not sz.is_static(p.shape[axis]):
        return None
    x, dims = p.inputs[0], p.attrs["dims"]
    if any(x.shape[k] != 1 for k, d in enumerate(dims) if d != axis):
        return None
    g, c = Graph(), int(p.shape[axis])
    if axis in dims and x.shape[dims.index(axis)] == c:
        return g.reshape(x, [c])
    return g.broadcast_in_dim(g.reshape(x, []), [c], [])


def _folded(n: Node, axes: tuple[int, int], steps, each_call: bool) -> Node | None:
    """contraction(x, w * scale) + shift for contraction n and the steps
    after it; None where the weights would be scaled at each call and that
    is not wanted (each_call off) or would cost more than the steps: the
    weights have as many elements as the result or more (ResNet-18's later
    layers at batch 2: folding them doubled its time), or either's size is
    known only at run time."""
    g = Graph()
    scale = shift = None
    for op, p, left in steps:
        scale, shift = _STEPS[op].fold(g, scale, shift, p, left)
    w = _scaled(g, n.inputs[1], axes[1], _once(scale))
    stored = w
    while stored.is_index_transpose:  # (those _scaled made)
        stored = stored.inputs[0]
    weights, result = sz.static_product(w.shape), sz.static_product(n.shape)
    if not stored.is_source and not (each_call and None not in (weights, result) and weights < result):
        return None
    out = Node(n.op, (n.inputs[0], w), n.attrs, n.shape, n.dtype)
    if shift is not None:
        out = g.binary("add", out, g.broadcast_in_dim(_once(constant_folded(shift)), n.shape, [axes[0]]))
    return out


def _add(g: Graph, scale, shift, p: Node, left: bool):
    return scale, p if shift is None else g.binary("add", shift, p)


def _sub(g: Graph, scale, shift, p: Node, left: bool):
    if left:  # y - p
        return scale, g.unary("neg", p) if shift is None else g.binary("sub", shift, p)
    return (g.unary("neg", _ones(g, p) if scale is None else scale),  # p - y
            p if shift is None else g.binary("sub", p, shift))


def _scaling(op: str, first_is_p: bool) -> Callable:
    """A mul or div step: scale and shift by p (the first scale is p itself where first_is_p)."""
    def fold(g: Graph, scale, shift, p: Node, left: bool):
        if _one(p):  # addmm's decomposition multiplies by a beta and an alpha of 1
            return scale, shift
        scale = p if scale is None and first_is_p else g.binary(op, _ones(g, p) if scale is None else scale, p)
        return scale, None if shift is None else g.binary(op, shift, p)
    return fold


class _Step(NamedTuple):
    """A per-channel elementwise op that folds: (g, scale, shift, p, left) -> (scale, shift)."""
    fold: Callable
    scales: bool  # multiplies (mul, div) rather than shifts (add, sub)
    either_side: bool = True  # y may be its right operand (p / y does not fold)


_STEPS = {"add": _Step(_add, False), "sub": _Step(_sub, False), "mul": _Step(_scaling("mul", True), True),
          "div": _Step(_scaling("div", False), True, either_side=False)}


def _once(v: Node) -> Node:
    """A per-channel value computed once into an array of its own, not again
    for each weight or output element it is broadcast to."""
    if v.op in UNARY_OPS + BINARY_OPS:
        return Node(v.op, v.inputs, {**v.attrs, "materialize": True}, v.shape, v.dtype)
    return v


def _one(p: Node) -> bool:
    while p.op in _SAME_VALUES:
        p = p.inputs[0]
    return p.is_constant and p.attrs["value"] == 1


def _ones(g: Graph, p: Node) -> Node:
    return g.broadcast_in_dim(g.constant(1.0, p.dtype), p.shape, [])


def _scaled(g: Graph, w: Node, dim: int, scale: Node) -> Node:
    """w scaled along dim (through the transposes it is read by, so that the
    scaling reads the stored weight in order); constant where both are."""
    perms = []
    while w.is_index_transpose:
        perms.append(w.attrs["perm"])
        dim, w = w.attrs["perm"][dim], w.inputs[0]
    out = constant_folded(g.binary("mul", w, g.broadcast_in_dim(scale, w.shape, [dim])))
    for perm in reversed(perms):
        out = g.transpose(out, perm)
    return out


_EVAL = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "neg": np.negative,
         "sqrt": np.sqrt, "reciprocal": np.reciprocal, "rsqrt": lambda v: 1 / np.sqrt(v)}


def constant_folded(n: Node) -> Node:
    """n as a tensor constant where its value is known at compile time
    (constants through layout and elementwise arithmetic), else n."""
    v = _value(n, {})
    if v is None or not all(map(sz.is_static, n.shape)):
        return n
    return Graph().tensor_constant(np.asarray(v, dtype=n.dtype.numpy).reshape(n.shape))


def _value(n: Node, memo: dict):
    if n.id in memo:
        return memo[n.id]
    v = None
    if n.op in _LEAVES:
        v = _LEAVES[n.op](n)
    else:
        ins = [_value(i, memo) for i in n.inputs]
        if all(x is not None for x in ins) and ins and all(map(sz.is_static, n.shape)):
            v = _apply(n, ins)
    memo[n.id] = v
    return v


def _apply(n: Node, ins):
    if n.op in _EVAL:
        with np.errstate(all="ignore"):
            return _EVAL[n.op](*ins).astype(n.dtype.numpy)
    return _LAYOUT[n.op](n, ins[0]) if n.op in _LAYOUT else None


def _broadcast(n: Node, v):
    shape = [1] * n.rank
    for k, d in enumerate(n.attrs["dims"]):
        shape[d] = v.shape[k]
    return np.broadcast_to(v.reshape(shape), n.shape)


_LEAVES = {"constant": lambda n: np.asarray(n.attrs["value"], dtype=n.dtype.numpy),
           "tensor_constant": lambda n: n.attrs["value"]}
_LAYOUT = {"reshape": lambda n, v: v.reshape(n.shape), "transpose": lambda n, v: v.transpose(n.attrs["perm"]),
           "cast": lambda n, v: v.astype(n.dtype.numpy), "broadcast_in_dim": _broadcast}
