"""The CPU target's graph passes.

A target owns the rewrites its code needs; the CPU's generated contractions
load vectors of the product's columns, so an operand that does not run
along them is packed first.
"""
from __future__ import annotations

import copy
import dataclasses

from .. import sizes as sz
from ..graph import Graph, Node


def packed_operands(graph: Graph, min_rows: int = 8) -> Graph:
    """A copy in which a contraction whose second operand does not run
    contiguously along the result's last dimension (x @ W.T, as
    nn.Linear computes) reads a copy of it laid out (batch, contracting,
    free): the CPU's register blocks load vectors along that dimension,
    and the copy costs one pass over the operand against a pass over it
    for every row block. Only where the first operand has `min_rows`
    rows or more (or a symbolic count)."""
    canon: dict[int, Node] = {}
    for old in graph.nodes():
        ins = tuple(canon[i.id] for i in old.inputs)
        n = old if all(a is b for a, b in zip(ins, old.inputs)) else dataclasses.replace(old, inputs=ins)
        if n.op == "dot_general":
            a, b = n.inputs
            at = n.attrs
            rf = [d for d in range(b.rank) if d not in at["rc"] and d not in at["rb"]]
            lf = [d for d in range(a.rank) if d not in at["lc"] and d not in at["lb"]]
            rows = sz.static_product(a.shape[d] for d in lf)
            if rf and not _innermost(b, rf[-1]) and (rows is None or rows >= min_rows):
                perm = tuple(at["rb"]) + tuple(at["rc"]) + tuple(rf)
                shape = tuple(b.shape[p] for p in perm)
                src = b
                while src.op == "transpose" and not src.attrs.get("materialize"):
                    perm, src = tuple(src.attrs["perm"][p] for p in perm), src.inputs[0]
                bt = Node("transpose", (src,), {"perm": perm, "materialize": True}, shape, b.dtype)
                nb, nc = len(at["rb"]), len(at["rc"])
                n = dataclasses.replace(n, inputs=(a, bt), attrs={
                    **at, "rb": tuple(range(nb)), "rc": tuple(range(nb, nb + nc))})
        canon[old.id] = n
    g = copy.copy(graph)
    g.outputs = [canon[o.id] for o in graph.outputs]
    return g


def _innermost(n: Node, d: int) -> bool:
    """Whether dimension d of n is the innermost of the memory it reads
    (transposes are access relations, not copies)."""
    while n.op == "transpose" and not n.attrs.get("materialize"):
        d, n = n.attrs["perm"][d], n.inputs[0]
    return d == n.rank - 1
