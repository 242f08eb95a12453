"""Channels-last activations between library convolutions (a graph pass).

cuDNN's fast convolutions (its tensor-core kernels) read and write NHWC.
Handed NCHW arrays, as eager PyTorch hands it, cuDNN converts them in and
out around every call. This pass gives each convolution that the library
computes channels-last arrays instead:
- its activation operands are read transposed, and made in that order
  wherever they are computed;
- its result is stored channels last;
- the elementwise ops, pads, slices, windows and reductions that read the
  result compute in the same order, as do those that read an input laid
  out channels last (a backward's saved activations: the frontend asks for
  them in this order, Target.output_orders).

So the arrays between convolutions (a ResNet's activations, its residuals
and its pooling) are channels last. The transposes that remain are index
functions (polyjit.lowering inlines them) where the order is not carried
on: at the graph's inputs and outputs, and at ops the pass does not carry
it through. The CPU runs the pass on stencils alone
(stencils_channels_last): those whose images are read out of channels-last
arrays.

A value stored in order p is ``transpose(value, p)``: its axis i is the
value's axis p[i]. Index computations (iotas, constants and elementwise ops
of them, such as the max pool's window masks) are rebuilt in that order
rather than read through a transpose.
"""
from __future__ import annotations

from typing import Callable

from . import sizes as sz
from .dtypes import DataType
from .graph import ELEMENTWISE, Graph, Node
from .library import _conv_reduction


def last(rank: int) -> tuple[int, ...]:
    """The order that moves an N, C, spatial... array's channels last."""
    return (0, *range(2, rank), 1)


def inverse(p: tuple[int, ...]) -> tuple[int, ...]:
    q = [0] * len(p)
    for i, a in enumerate(p):
        q[a] = i
    return tuple(q)


def _moved(values: tuple, p: tuple[int, ...]) -> tuple:
    return tuple(values[a] for a in p)


def convertible(n: Node) -> bool:
    """Whether convolution n reads and writes activations as N, C, spatial
    arrays (2-d or 3-d, float32): a forward or input gradient ("NC..."
    images) or a weight gradient ("CN...": the images are the contraction,
    the output gradient its kernel, "IO...")."""
    if n.op != "conv" or not 4 <= n.rank <= 5 or any(t.dtype != DataType.Float for t in (n, *n.inputs)):
        return False
    lay, klay = n.attrs["layout"], n.attrs["kernel_layout"]
    sp = lay[2:]
    if set(sp) & set("NCIO") or len(sp) != n.rank - 2:
        return False
    if lay == "NC" + sp:
        return klay in ("OI" + sp, "IO" + sp)
    return lay == "CN" + sp and klay == "IO" + sp and n.attrs["groups"] == 1


def _stencil_kernel_order(n: Node) -> tuple[int, ...] | None:
    """The kernel's order for a convolution of images (NC...) that the
    library leaves to generated code as a stencil (its rule,
    library._conv_reduction: a depthwise one): its
    window, then I, then O. Its output channels, the images' last axis,
    are then the kernel's too, so a tap's weights for a vector of channels
    are one vector load (OHWI made them loads 25 floats apart, each a
    transaction of its own per thread, for a 5x5 window); the kernel is
    copied so (a small array). None for the others: cuDNN's channels-last
    convolutions read OHWI."""
    lay, klay, ws = n.attrs["layout"], n.attrs["kernel_layout"], n.inputs[1].shape
    if not lay.startswith("NC") or not all(map(sz.is_static, ws)) or _conv_reduction(n, None, ws)[1] is None:
        return None
    return tuple(klay.index(c) for c in (*(c for c in klay if c not in "IO"), "I", "O"))


class _Pass:
    """One run of the pass: the values stored in another order so far."""

    def __init__(self, stencils: bool, converts: Callable[[Node], bool] = convertible, reads: bool = True) -> None:
        self.stencils = stencils
        self.converts = converts  # the convolutions computed channels last
        self.reads = reads  # whether the readers of a channels-last input compute in its order
        self.stored: dict[int, tuple[Node, tuple[int, ...]]] = {}  # old node id -> (the value in order p, p)
        self.rebuilt: dict[tuple[int, tuple], Node] = {}  # (new node id, p) -> the node in order p
        self.index_only: dict[int, bool] = {}

    def step(self, old: Node, n: Node, new: dict[int, Node]) -> Node:
        if self.converts(old):
            return self._convolution(old, n)
        orders = {self.stored[i.id][1] for i in old.inputs if i.id in self.stored}
        if not orders and self.reads and _read_channels_last(old):  # (a backward's saved activation, an input)
            self.stored[old.id] = (n.inputs[0], last(old.rank))
            return n
        if len(orders) != 1 or old.op not in CARRIED:
            return n
        p = orders.pop()
        if any(i.rank != len(p) for i in n.inputs):
            return n
        carried = CARRIED[old.op](n, p)
        if carried is None:
            return n
        made, q = carried(tuple(self._operand(o, i, p) for o, i in zip(old.inputs, n.inputs)))
        return self._keep(old, made, q)

    def _keep(self, old: Node, made: Node, q: tuple[int, ...]) -> Node:
        """made, old's value in order q, for the consumers that carry it;
        old's value itself (a transpose of made) for the others."""
        if q == tuple(range(len(q))):
            return made
        self.stored[old.id] = (made, q)
        return _transpose(made, inverse(q))

    def _convolution(self, old: Node, n: Node) -> Node:
        p = last(old.rank)
        q = (self.stencils and _stencil_kernel_order(old)) or p
        at = n.attrs
        x = self._operand(old.inputs[0], n.inputs[0], p)
        w = self._operand(old.inputs[1], n.inputs[1], q)
        if q != p and w.is_index_transpose:  # (a copy: read through its index function, the taps are apart again)
            w = Node("transpose", w.inputs, {**w.attrs, "materialize": True}, w.shape, w.dtype)
        attrs = {**at, "layout": "".join(_moved(at["layout"], p)),
                 "kernel_layout": "".join(_moved(at["kernel_layout"], q))}
        return self._keep(old, Node("conv", (x, w), attrs, _moved(n.shape, p), n.dtype), p)

    def _operand(self, old: Node, n: Node, p: tuple[int, ...]) -> Node:
        """Operand old (new node n) in order p."""
        kept = self.stored.get(old.id)
        if kept is not None and kept[1] == p:
            return kept[0]
        return self._in_order(n, p)

    def _in_order(self, n: Node, p: tuple[int, ...]) -> Node:
        """transpose(n, p), rebuilt in that order where n is an index
        computation or a view that has one (a broadcast, a reverse)."""
        key = (n.id, p)
        if key not in self.rebuilt:
            self.rebuilt[key] = self._rebuild(n, p)
        return self.rebuilt[key]

    def _rebuild(self, n: Node, p: tuple[int, ...]) -> Node:
        shape = _moved(n.shape, p)
        if n.op == "iota":
            return Node("iota", (), {**n.attrs, "dim": p.index(n.attrs["dim"])}, shape, n.dtype)
        if n.op == "broadcast_in_dim":
            dims = tuple(p.index(d) for d in n.attrs["dims"])
            if list(dims) == sorted(dims):
                return Node("broadcast_in_dim", n.inputs, {"dims": dims}, shape, n.dtype)
        if n.op == "reverse":
            axes = tuple(sorted(p.index(a) for a in n.attrs["axes"]))
            return Node("reverse", (self._in_order(n.inputs[0], p),), {"axes": axes}, shape, n.dtype)
        if n.op == "transpose":
            return _transpose(n.inputs[0], tuple(n.attrs["perm"][a] for a in p))
        if n.op in ELEMENTWISE and self._index_only(n) and all(i.rank == len(p) for i in n.inputs):
            return Node(n.op, tuple(self._in_order(i, p) for i in n.inputs), n.attrs, shape, n.dtype)
        return _transpose(n, p)

    def _index_only(self, n: Node) -> bool:
        """Whether n is computed from indices and constants alone (no array read)."""
        if n.id not in self.index_only:
            self.index_only[n.id] = not n.is_source and all(self._index_only(i) for i in n.inputs)
        return self.index_only[n.id]


def _read_channels_last(n: Node) -> bool:
    """Whether n reads a channels-last array as N, C, spatial...: its
    readers then compute channels last too."""
    return (n.is_index_transpose and 4 <= n.rank <= 5
            and inverse(tuple(n.attrs["perm"])) == last(n.rank))


def _transpose(x: Node, p: tuple[int, ...]) -> Node:
    if p == tuple(range(len(p))):
        return x
    return Node("transpose", (x,), {"perm": p}, _moved(x.shape, p), x.dtype)


# How each op the order is carried through computes in order p: carry(n, p)
# gives None where it cannot, else a function of n's operands in order p
# that returns (n's value in order q, q).
def _elementwise(n: Node, p: tuple) -> Callable:
    return lambda ins: (Node(n.op, ins, n.attrs, _moved(n.shape, p), n.dtype), p)


def _per_axis(*names: str) -> Callable:
    """An op whose attributes names hold a value per axis, in axis order."""
    def carry(n: Node, p: tuple) -> Callable:
        attrs = {k: (_moved(tuple(v), p) if k in names else v) for k, v in n.attrs.items()}
        return lambda ins: (Node(n.op, ins, attrs, _moved(n.shape, p), n.dtype), p)
    return carry


def _reduce(n: Node, p: tuple) -> Callable:
    """Over the same axes in their new places; the axes left are in the order
    they have in p, which is the result's order q."""
    axes = tuple(sorted(p.index(a) for a in n.attrs["axes"]))
    if n.attrs.get("keepdim"):
        q = p
    else:
        kept = [a for a in p if a not in n.attrs["axes"]]
        ordered = sorted(kept)
        q = tuple(ordered.index(a) for a in kept)

    def made(ins: tuple) -> tuple[Node, tuple]:
        shape = tuple(ins[0].shape[d] if d not in axes else 1 for d in range(len(p))
                      if n.attrs.get("keepdim") or d not in axes)
        return Node("reduce", ins, {**n.attrs, "axes": axes}, shape, n.dtype), q
    return made


def _scatter(n: Node, p: tuple) -> Callable | None:
    """A scatter whose index and values match the result axis for axis
    (torch.scatter_add: a max pool's gradient) along the same axis moved."""
    if not n.attrs["along"]:
        return None
    attrs = {**n.attrs, "axis": p.index(n.attrs["axis"])}
    return lambda ins: (Node("scatter", ins, attrs, _moved(n.shape, p), n.dtype), p)


def _reshape(n: Node, p: tuple) -> Callable | None:
    """A reshape that merges or splits runs of axes which p keeps together,
    each in its order (the spatial axes of a channels-last image, flattened
    for a max pool's gradient): the same reshape of the stored array, its
    runs in p's order."""
    runs = _runs(n.inputs[0].shape, n.shape)
    if runs is None:
        return None
    first = {a[0]: k for k, (a, _) in enumerate(runs)}
    order, at = [], 0
    while at < len(p):
        k = first.get(p[at])
        if k is None or tuple(p[at:at + len(runs[k][0])]) != runs[k][0]:
            return None
        order.append(k)
        at += len(runs[k][0])
    q = tuple(b for k in order for b in runs[k][1])
    return lambda ins: (Node("reshape", ins, n.attrs, _moved(n.shape, q), n.dtype), q)


def _runs(a: tuple, b: tuple) -> list[tuple[tuple, tuple]] | None:
    """The reshape of shape a into b as runs of a's axes that become runs of
    b's, each holding as many values (None: symbolic sizes, or a run empty)."""
    if not all(sz.is_static(s) for s in (*a, *b)):
        return None
    a, b = [int(s) for s in a], [int(s) for s in b]
    runs, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        i0, j0, na, nb = i, j, a[i], b[j]
        i, j = i + 1, j + 1
        while na != nb:
            if na < nb and i < len(a):
                na, i = na * a[i], i + 1
            elif nb < na and j < len(b):
                nb, j = nb * b[j], j + 1
            else:
                return None
        runs.append((tuple(range(i0, i)), tuple(range(j0, j))))
    if not runs or any(s != 1 for s in a[i:] + b[j:]):
        return None
    runs[-1] = (runs[-1][0] + tuple(range(i, len(a))), runs[-1][1] + tuple(range(j, len(b))))
    return runs


def _transposed(n: Node, p: tuple) -> Callable | None:
    """A transpose of a value stored in order p: a transpose of the stored
    array, the array itself where it undoes p (an output asked for in order
    p is then the array its producer stores, not a copy of it)."""
    if not n.is_index_transpose:
        return None
    perm = tuple(inverse(p)[a] for a in n.attrs["perm"])
    return lambda ins: (_transpose(ins[0], perm), tuple(range(len(p))))


CARRIED: dict[str, Callable] = {op: _elementwise for op in ELEMENTWISE}
CARRIED.update({"pad": _per_axis("lo", "hi"), "slice": _per_axis("start", "strides"),
                "reduce_window": _per_axis("window", "strides", "padding", "dilation"), "reduce": _reduce,
                "scatter": _scatter, "reshape": _reshape, "transpose": _transposed})


def channels_last(graph: Graph, stencils: bool = True) -> Graph:
    """A copy of graph in which each ``convertible`` convolution reads and
    writes channels-last arrays, and the ops after it compute in that order;
    stencils: whether convolutions the library leaves to generated code
    take their kernel window first (not where the options send every one
    to the library)."""
    return graph.rewritten(_Pass(stencils).step)


def _stencil_of_channels_last(n: Node) -> bool:
    """Whether n is a stencil convolution (a depthwise one) of images read
    transposed from channels-last arrays."""
    return convertible(n) and _stencil_kernel_order(n) is not None and _read_channels_last(n.inputs[0])


def stencils_channels_last(graph: Graph) -> Graph:
    """A copy of graph in which each stencil convolution of images read out
    of channels-last arrays (ConvNeXt's depthwise convolution, between
    permutes of a layer norm's channels-last rows) computes channels last,
    as do the ops after it that carry the order. Read as N, C, spatial...,
    a tap's neighbours along a row are the same channel's, and a nest that
    writes channels last (the permute back) runs channels innermost, so
    each output gathered its window one plane apart, guarded, in scalar
    code; channels last, a tap is a vector of channels, its guard one per
    position."""
    return graph.rewritten(_Pass(True, _stencil_of_channels_last, reads=False).step)
