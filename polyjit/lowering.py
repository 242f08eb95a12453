"""Graph -> affine program: each core op lowered once.

An op is either *inlined* (its scalar expression is substituted into its
consumers, so layout ops become index functions and elementwise chains become
one body) or *materialized* (it gets an array and statements). A graph pass
may ask for an array: attribute ``materialize`` (a value computed once,
fold's per-channel scales) or ``packed`` (an operand's copy laid out for
register blocks, not made where only library calls read it). Reductions,
contractions and windows are written once as a :class:`ReductionSpec`; small
static windows (a 1x5 blur tap, a 3x3 pooling window) unroll into an
expression, larger ones become an init and an update statement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Sequence

from . import expr as E
from . import scalar
from . import sizes as sz
from .affine import AffineProgram, Array, Role, Statement, loop_nest
from .columns import columns_form, lower_columns, shifted
from .dtypes import DataType
from .errors import DefinitionError, UnsupportedOpError
from .expr import Const, Expr, Load, Op
from .graph import BINARY_OPS, CONTRACTIONS, UNARY_OPS, Graph, Node, free_dims
from .library import READS_ONCE
from .sizes import Lin, Size

UNROLL_LIMIT = 16  # reductions with at most this many static terms unroll into expressions
STENCIL_UNROLL_LIMIT = 49  # likewise a convolution over its window alone (depthwise, up to 7x7)
RECOMPUTE_LIMIT = 6  # extra work accepted to inline a value read more than once
MANY = 16  # weight of a read inside a contraction's reduction loop


@dataclass
class ReductionSpec:
    """out[o] = combine over r in red_sizes of term(o, r)."""

    red_sizes: list[Size]
    term: Callable[[tuple[Expr, ...], tuple[Expr, ...]], Expr]
    combine: str
    extra: str = ""  # isl constraints relating reduction and output iterators
    unroll: int = UNROLL_LIMIT  # the most terms that unroll into one expression
    reads_once: bool = False  # each operand element feeds one term at most (a reduce, a window that
    # tiles its operand, not a product)

    def static_terms(self) -> int | None:
        if self.extra or not all(sz.is_static(s) for s in self.red_sizes):
            return None
        return math.prod(int(s) for s in self.red_sizes)


def identity(combine: str, dt: DataType) -> Const:
    return E.const(scalar.identity(combine, dt), dt)


class Lowering:
    def __init__(self, graph: Graph, recompute_limit: int = RECOMPUTE_LIMIT, library=None, load_work: int = 0) -> None:
        self.g = graph
        self.recompute_limit = recompute_limit
        self._positional: dict[int, bool] = {}
        self.load_work = load_work  # the work a recomputation's load of a whole array counts as
        self.library = library  # a polyjit.library.LibraryPolicy, or None: every contraction generated
        self.library_nodes: set[int] = set()
        self.in_place: set[int] = set()  # packed copies only library calls read: not made
        self.views: dict[int, int] = {}  # outputs that are reshapes of a temporary: handed out as views of it
        self.operands: set[int] = set()  # what library calls (or products, unravelled) read whole: made
        self.columns: dict[int, tuple] = {}  # generated convolutions as products along positions
        # (polyjit.columns) -> (the shape their result is stored in, the sizes its positions run over)
        self.nodes = graph.nodes()
        self.arrays: dict[str, Array] = {}
        self.statements: list[Statement] = []
        self.array_of: dict[int, str] = {}
        self.memo: dict[tuple, Expr] = {}
        self.packs: dict[tuple, str] = {}  # a product operand's copies by (shape, dtype, value): made once
        self.inlined = 0

    # ------------------------------------------------------------- helpers
    def shape(self, n: Node) -> tuple[Size, ...]:
        return tuple(self.g.resolve(s) for s in n.shape)

    def value(self, n: Node, idx: Sequence[Expr]) -> Expr:
        """The scalar value of n at idx, inlined or loaded."""
        idx = tuple(idx)
        key = (n.id, idx)
        if key not in self.memo:
            if n.id in self.array_of:
                self.memo[key] = Load(n.dtype, self.array_of[n.id], idx)
            else:
                self.memo[key] = self.inline(n, idx)
        return self.memo[key]

    def inline(self, n: Node, idx: tuple[Expr, ...]) -> Expr:
        if n.op in INLINE:
            return INLINE[n.op](self, n, idx)
        spec = REDUCTIONS[n.op](self, n)
        return self.unrolled(spec, n.dtype, idx)

    def unrolled(self, spec: ReductionSpec, dt: DataType, idx) -> Expr:
        acc: Expr | None = None
        for combo in _product([int(s) for s in spec.red_sizes]):
            t = spec.term(idx, tuple(E.const(c) for c in combo))
            acc = t if acc is None else Op(dt, scalar.COMBINE[spec.combine], (acc, t))
        return acc if acc is not None else identity(spec.combine, dt)

    # ------------------------------------------------------------ decisions
    def packed(self, n: Node) -> bool:
        """Whether n is an operand's copy laid out for generated register
        blocks (targets.cpu.packed_operands) that a contraction needs: a library call reads
        the original through its transposition instead."""
        return bool(n.attrs.get("packed")) and n.id not in self.in_place

    def is_statement_op(self, n: Node) -> bool:
        if n.op in STATEMENT_OPS or n.id in self.library_nodes or n.id in self.columns:
            return True
        if n.op in REDUCTIONS:
            spec = REDUCTIONS[n.op](self, n)
            terms = spec.static_terms()
            return terms is None or terms > spec.unroll
        return False

    def elements(self, n: Node) -> int:
        return math.prod(sz.estimate(s) for s in self.shape(n))

    def read_weight(self, consumer: Node, operand: int) -> int:
        if consumer.id in self.library_nodes and consumer.op in READS_ONCE:  # in place, or one copy for the call
            return 1
        if consumer.id in self.columns and operand == 0 and shifted(self, consumer, self.columns[consumer.id][1]):
            return 1  # (its padded copy, where a producer is computed)
        if consumer.op in REDUCTIONS:
            spec = REDUCTIONS[consumer.op](self, consumer)
            spec_terms = spec.static_terms()
            if spec.reads_once:
                return 1
            if spec_terms is not None and spec_terms <= spec.unroll:
                return max(spec_terms, 1)
            return MANY
        if SCATTERED_READS.get(consumer.op) == operand:
            return MANY
        index = consumer.inputs[operand]
        if consumer.op == "gather" and operand == 1 and self.elements(consumer) > self.elements(index) \
                and self.positional(index):
            return MANY  # an index table computed from positions (an upsampling's rows): each entry is
            # read for every element it selects
        return 1

    def positional(self, n: Node) -> bool:
        return from_positions(n, self._positional)

    def plan(self) -> None:
        if self.library is not None:
            self.library.prefetch(self, [n for n in self.nodes if n.op in CONTRACTIONS])
            self.library_nodes = {n.id for n in self.nodes if n.op in CONTRACTIONS
                                  and self.library.use(self, n)}
            self.in_place = _read_in_place(self.nodes, self.library_nodes)
            from .library import direct_operands
            self.operands = direct_operands(self, self.library_nodes) | self.unravelled_operands()
            for n in self.nodes:
                stored = None if n.id in self.library_nodes else columns_form(self, n)
                if stored is not None:
                    self.columns[n.id] = stored
        uses: dict[int, int] = {n.id: 0 for n in self.nodes}
        for n in self.nodes:
            for k, i in enumerate(n.inputs):
                uses[i.id] += self.read_weight(n, k)
        work: dict[int, int] = {}
        outputs = {o.id for o in self.g.outputs}
        readers: dict[int, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                readers.setdefault(i.id, []).append(n)
        loaded: dict[int, int] = {}  # whole arrays that reading one element of a node loads
        for n in self.nodes:
            if n.is_source:
                self.declare(n)
                work[n.id], loaded[n.id] = 0, 1
                continue
            if n.is_constant:
                work[n.id] = loaded[n.id] = 0
                continue
            own = scalar.cost(n.op) if n.op in UNARY_OPS + BINARY_OPS else (
                0 if n.op in LAYOUT_OPS else 1)
            if n.op in REDUCTIONS and not self.is_statement_op(n):
                own = 2 * (REDUCTIONS[n.op](self, n).static_terms() or 1)
            w = own + sum(work[i.id] for i in n.inputs)
            size = self.elements(n)
            loaded[n.id] = sum(loaded[i.id] for i in n.inputs if self.elements(i) >= size)
            if n.id in outputs and self.returned_as_view(n, outputs):
                self.views[n.id] = n.inputs[0].id
                work[n.id] = w
                continue
            required = (n.id in outputs or self.is_statement_op(n) or self.packed(n) or n.id in self.operands
                        or n.attrs.get("materialize"))
            materialize = required or (uses[n.id] - 1) * (w + self.load_work * loaded[n.id]) > self.recompute_limit
            if materialize and not required and self.made_unbroadcast(n):
                self.declare(n.inputs[0])  # made once at its own size, read through the broadcast
                self.inlined -= 1  # (counted when it was passed over)
                work[n.id], loaded[n.id] = 0, 1
            elif materialize and n.op == "reshape" and n.id not in outputs and self.made_unreshaped(n, readers):
                self.declare(n.inputs[0])  # n, a view of it, is read in place
                self.inlined -= 1  # (counted when it was passed over)
                work[n.id], loaded[n.id] = 0, 1
            elif materialize and self.scatters_in_place(n, readers, outputs):
                self.array_of[n.id] = self.array_of[n.inputs[2].id]  # (its base's array: _scatter)
                work[n.id], loaded[n.id] = 0, 1
            elif materialize:
                self.declare(n)
                work[n.id], loaded[n.id] = 0, 1
            else:
                work[n.id] = w
                self.inlined += 1

    def unravelled_operands(self) -> set[int]:
        """The reshapes over symbolic sizes that generated products read
        (through transposes): made once, so that a product's inner loop
        reads plain indices, not the reshape's run-time divisions."""
        out = set()
        for n in self.nodes:
            if n.op != "dot_general" or n.id in self.library_nodes:
                continue
            for x in n.inputs:
                while x.op == "transpose":
                    x = x.inputs[0]
                if x.op == "reshape" and _unravels(self.shape(x.inputs[0]), self.shape(x)):
                    out.add(x.id)
        return out

    def made_unbroadcast(self, n: Node) -> bool:
        """Whether broadcast n, worth making rather than recomputing where it
        is read, is better made as its computed operand at the operand's
        size (an upsampling's column weights: a row of them, not an image)."""
        x = n.inputs[0]
        return (n.op == "broadcast_in_dim" and x.id not in self.array_of and not x.is_source
                and not x.is_constant and x.op not in LAYOUT_OPS and self.elements(x) < self.elements(n))

    def made_unreshaped(self, n: Node, readers: dict[int, list[Node]]) -> bool:
        """Whether reshape n, which only library matrix products read (each
        one matrix, in place: any reshape of a row-major array is one), is
        better made as its computed operand in the operand's own shape: a
        transformer's layer norm, [b, s, e], into its projections as
        [b*s, e]. The statement then reads its producers at plain indices
        (not through the reshape's divisions) and shares their kernel."""
        x = n.inputs[0]
        if x.id in self.array_of or x.is_source or x.is_constant or x.op in LAYOUT_OPS or self.packed(x):
            return False
        return all(r.id in self.library_nodes and r.op == "dot_general" and not r.attrs["lb"]
                   for r in readers.get(n.id, ()))

    def scatters_in_place(self, n: Node, readers: dict[int, list[Node]], outputs: set[int]) -> bool:
        """Whether scatter n, into a base (a tied embedding's gradient into
        the output projection's), scatters into the base's own array: a
        temporary of the base's alone, of n's shape, that only n reads.
        The base's statements (a library product among them) then write
        n's array, and no copy starts it."""
        b = scatter_base(n)
        if b is None:
            return False
        name = self.array_of.get(b.id)
        return (name is not None and b.id not in outputs and [r.id for r in readers.get(b.id, ())] == [n.id]
                and self.arrays[name].kind == "temp" and self.arrays[name].shape == self.shape(n)
                and self.arrays[name].dtype == n.dtype and list(self.array_of.values()).count(name) == 1)

    def returned_as_view(self, n: Node, outputs: set[int]) -> bool:
        """Whether output n is a reshape of a temporary that can be the output
        itself, handed out reshaped (a library product's result: no copy)."""
        if n.op not in VIEWS:
            return False
        x = n.inputs[0]
        name = self.array_of.get(x.id)
        return (name is not None and self.arrays[name].kind == "temp" and x.id not in outputs
                and self.arrays[name].shape == self.shape(x)
                and x.id not in self.views.values() and n.id not in self.operands)  # (a library call reads n whole)

    def declare(self, n: Node) -> None:
        if n.is_input:
            name, kind, index = f"in{n.attrs['index']}", "input", n.attrs["index"]
        elif n.is_source:  # a tensor constant
            index = sum(a.kind == "const" for a in self.arrays.values())
            name, kind = f"c{index}", "const"
        else:
            name, kind, index = f"t{n.id}", "temp", -1
        shape = self.columns[n.id][0] if n.id in self.columns else self.shape(n)
        self.arrays[name] = Array(name, shape, n.dtype, kind,
                                  strided=bool(n.attrs.get("strided")), index=index)
        self.array_of[n.id] = name

    def declare_array(self, name: str, shape, dtype: DataType) -> None:
        """A temporary of a lowering's own (an im2col matrix, a packed kernel)."""
        self.arrays[name] = Array(name, tuple(shape), dtype, "temp")

    # ---------------------------------------------------------- statements
    def emit(self) -> None:
        for n in self.nodes:
            name = self.array_of.get(n.id)
            if name is None or self.arrays[name].kind not in ("temp", "output"):
                continue
            iters, idx, bounds = loop_nest(self.shape(n))
            if n.id in self.library_nodes:
                from .library import LOWER
                LOWER[n.op](self, n, name)
            elif n.id in self.columns:
                lower_columns(self, n, name, self.columns[n.id][1])
            elif n.op in STATEMENT_OPS:
                STATEMENT_OPS[n.op](self, n, name)
            elif n.op in REDUCTIONS and self.is_statement_op(n):
                spec = REDUCTIONS[n.op](self, n)
                product = n.op in CONTRACTIONS
                acc, dt = name, n.dtype
                if dt in (DataType.Half, DataType.BFloat16) and spec.combine in scalar.WIDENING:
                    acc, dt = f"{name}_sum", DataType.Float  # summed in float32, rounded once (as eager's products)
                    self.declare_array(acc, self.shape(n), dt)
                self.add(acc, iters, bounds, idx, identity(spec.combine, dt), n.op + "_init", role=Role.INIT,
                         contraction=product)
                riters, ridx, rbounds = loop_nest(spec.red_sizes, "r")
                self.add(acc, iters + riters, bounds + rbounds, idx, spec.term(idx, ridx), n.attrs.get("op", n.op),
                         combine=spec.combine, reduction_iters=riters, extra=spec.extra, role=Role.UPDATE,
                         contraction=product)
                if acc != name:
                    self.add(name, iters, bounds, idx, Op(n.dtype, "cast", (Load(dt, acc, idx),)), "cast")
            else:
                self.add(name, iters, bounds, idx, self.inline(n, idx), n.op)

    def add(self, array, iters, bounds, index, body, label, **kw) -> None:
        self.statements.append(Statement(f"S{len(self.statements)}", tuple(iters), tuple(bounds),
                                         array, tuple(index), body, label=label, **kw))

    def run(self) -> AffineProgram:
        unknown = sz.unsolved([self.g.resolve(s) for s in n.shape] for n in self.g.inputs)
        if unknown:  # (a product's factors not the size of any input's dimension alone)
            raise UnsupportedOpError(f"sizes {sorted(unknown)} that no input's dimension has alone")
        self.plan()
        for n in self.g.inputs:  # unused inputs are still arguments
            if n.id not in self.array_of:
                self.declare(n)
        outputs: list[str] = []
        first: dict[int, str] = {}  # a node returned twice is one array
        unwidened: list[tuple] = []  # (output, its wide temporary, node): a shifted convolution's result
        for k, o in enumerate(self.g.outputs):
            if o.id in first:
                outputs.append(first[o.id])
                continue
            out = f"out{k}"
            first[o.id] = out
            outputs.append(out)
            if o.id in self.views:  # the temporary it reshapes becomes the output
                arr = self.arrays.pop(self.array_of[self.views[o.id]])
                self.arrays[out] = Array(out, arr.shape, arr.dtype, "output", index=k, returned_as=self.shape(o))
                self.array_of[self.views[o.id]] = out
                continue
            src = self.array_of.get(o.id)
            if src is None:  # a value only ever computed inline (a constant): into the output
                shape = self.shape(o)
                iters, idx, bounds = loop_nest(shape)
                self.arrays[out] = Array(out, tuple(shape), o.dtype, "output", index=k)
                self.add(out, iters, bounds, idx, self.inline(o, idx), o.op)
                continue
            arr = self.arrays[src]
            if o.id in self.columns and tuple(arr.shape) != tuple(self.shape(o)):  # (rows wider: copied out)
                self.arrays[out] = Array(out, tuple(self.shape(o)), o.dtype, "output", index=k)
                unwidened.append((out, src, o))
                continue
            self.arrays[out] = Array(out, arr.shape, arr.dtype, "output", index=k)
            if arr.kind == "temp":
                del self.arrays[src]
                for m, name in list(self.array_of.items()):  # (a scatter's base shares its array)
                    if name == src:
                        self.array_of[m] = out
            else:  # an input or constant returned as is: copy it
                iters, idx, bounds = loop_nest(self.shape(o))
                self.add(out, iters, bounds, idx, Load(arr.dtype, src, idx), "copy")
        self.emit()
        for out, src, o in unwidened:  # just after the product (its rows Wp wide: polyjit.columns)
            iters, idx, bounds = loop_nest(self.shape(o))
            self.add(out, iters, bounds, idx, Load(o.dtype, src, idx), "copy")
            last = max(k for k, st in enumerate(self.statements) if st.array == src)
            self.statements.insert(last + 1, self.statements.pop())
        self.statements = _copies_beside_producers(self.statements)
        params = sorted({p for a in self.arrays.values() for s in a.shape
                         if isinstance(s, Lin) for p in s.params()})
        for a in self.g.inputs:
            for s in a.shape:
                if isinstance(s, Lin):
                    params.extend(p for p in self.g.resolve(s).params() if p not in params)
        for st in self.statements:  # sizes read as values, or bounding loops and library calls only
            call = [getattr(st.library, f.name) for f in fields(st.library)] if st.library is not None else []
            params.extend(_params_in((st.body, st.index, st.bounds, call)))
        params.extend(p for p in list(params) for p in Lin.param(p).base_params())
        constraints = [(self.g.resolve(a), self.g.resolve(b)) for a, b in self.g.constraints]
        return AffineProgram(sorted(set(params)), self.arrays, self.statements, outputs,
                             constraints, self.inlined)


def _params_in(value) -> set[str]:
    """The size parameters a statement's bounds or a library call's fields
    name (sizes, index expressions, tuples of them)."""
    if isinstance(value, Lin):
        return value.params()
    if isinstance(value, Expr):
        return {x.name for x in E.walk(value) if isinstance(x, E.Var) and x.kind == "param"}
    if isinstance(value, (tuple, list)):
        return set().union(*map(_params_in, value)) if value else set()
    return set()


def _copies_beside_producers(statements: list[Statement]) -> list[Statement]:
    """The statements with each library operand's copy ("pack") moved up to
    just after the last statement writing what it reads (nothing between
    reads its array, which only its product reads), and renamed in order:
    a copy emitted with its product (after the value's projection, in
    attention) then joins its producer's fusion group (the softmax, whose
    row it normalizes)."""
    order = list(statements)
    for st in statements:
        if st.label != "pack" or st.library is not None:
            continue
        reads = {ld.array for ld in E.loads(st.body)}
        at = order.index(st)
        last = max((k for k in range(at) if order[k].array in reads), default=None)
        if last is None or last + 1 >= at:
            continue
        order.insert(last + 1, order.pop(at))
    return [s if s.name == f"S{k}" else replace(s, name=f"S{k}") for k, s in enumerate(order)]


def _product(extents: list[int]):
    if not extents:
        yield ()
        return
    for head in range(extents[0]):
        for tail in _product(extents[1:]):
            yield (head,) + tail


def lower(graph: Graph, recompute_limit: int = RECOMPUTE_LIMIT, library=None, load_work: int = 0) -> AffineProgram:
    return Lowering(graph, recompute_limit, library, load_work).run()


# ====================================================== inline lowerings
def _elementwise(L: Lowering, n: Node, idx):
    args = tuple(L.value(i, idx) for i in n.inputs)
    if _inverse_root(n.op, args):  # one instruction where the target has it
        return Op(n.dtype, "rsqrt", args[-1].args)
    return Op(n.dtype, n.op, args)


def _inverse_root(op: str, args: tuple) -> bool:
    """Whether op(args) is reciprocal(sqrt(x)) or 1 / sqrt(x): a batch
    norm's inverse deviation, as decompositions write it."""
    root = args[-1]
    if not (isinstance(root, Op) and root.op == "sqrt"):
        return False
    return op == "reciprocal" or (op == "div" and isinstance(args[0], Const) and args[0].value == 1.0)


def _where(L, n, idx):
    return Op(n.dtype, "select", tuple(L.value(i, idx) for i in n.inputs))


def _cast(L, n, idx):
    return Op(n.dtype, "cast", (L.value(n.inputs[0], idx),))


def _constant(L, n, idx):
    return E.const(n.attrs["value"], n.dtype)


def _size(L, n, idx):
    return E.size_expr(L.g.resolve(n.attrs["size"]))


def _iota(L, n, idx):
    return Op(n.dtype, "cast", (idx[n.attrs["dim"]],)) if n.dtype != DataType.Int else idx[n.attrs["dim"]]


def _broadcast(L, n, idx):
    x = n.inputs[0]
    return L.value(x, [E.const(0) if x.shape[k] == 1 else idx[d]
                       for k, d in enumerate(n.attrs["dims"])])


def _transpose(L, n, idx):
    perm = n.attrs["perm"]
    src = [None] * len(perm)
    for k, p in enumerate(perm):
        src[p] = idx[k]
    return L.value(n.inputs[0], src)


def _slice(L, n, idx):
    return L.value(n.inputs[0], [E.iadd(E.imul(i, st), E.size_expr(L.g.resolve(s)))
                                 for i, s, st in zip(idx, n.attrs["start"], n.attrs["strides"])])


def _reverse(L, n, idx):
    x = n.inputs[0]
    shape = L.shape(x)
    return L.value(x, [E.isub(E.size_expr(shape[d] - 1), i) if d in n.attrs["axes"] else i
                       for d, i in enumerate(idx)])


def _in_bounds(idx, shape) -> Expr | None:
    cond = None
    for i, s in zip(idx, shape):
        if isinstance(i, Const) and isinstance(s, int) and 0 <= i.value < s:
            continue
        c = Op(DataType.Bool, "logical_and", (Op(DataType.Bool, "ge", (i, E.const(0))),
                                              Op(DataType.Bool, "lt", (i, E.size_expr(s)))))
        cond = c if cond is None else Op(DataType.Bool, "logical_and", (cond, c))
    return cond


def guarded(L: Lowering, x: Node, idx, fill: Expr, dims) -> Expr:
    """x at idx where idx is inside x along dims, else fill; the load stays in bounds."""
    shape = L.shape(x)
    cond = _in_bounds([idx[d] for d in dims], [shape[d] for d in dims])
    if cond is None:
        return L.value(x, idx)
    safe = [E.iclamp(i, E.const(0), E.size_expr(s - 1)) if d in dims and not isinstance(i, Const)
            else i for d, (i, s) in enumerate(zip(idx, shape))]
    return Op(x.dtype, "select", (cond, L.value(x, safe), fill))


def _pad(L, n, idx):
    x = n.inputs[0]
    lo, hi = n.attrs["lo"], n.attrs["hi"]
    return guarded(L, x, [E.isub(i, E.const(a)) for i, a in zip(idx, lo)],
                   E.const(n.attrs["value"], n.dtype),
                   [d for d in range(x.rank) if lo[d] or hi[d]])


def _concatenate(L, n, idx):
    axis = n.attrs["axis"]
    parts, offset = [], 0
    for x in n.inputs:
        parts.append((offset, x))
        offset = offset + L.shape(x)[axis]
    res: Expr | None = None
    for off, x in reversed(parts):
        size = L.shape(x)[axis]
        local = list(idx)
        local[axis] = E.isub(idx[axis], E.size_expr(off))
        if res is None:
            local[axis] = E.iclamp(local[axis], E.const(0), E.size_expr(size - 1))
            res = L.value(x, local)
            continue
        local[axis] = E.iclamp(local[axis], E.const(0), E.size_expr(size - 1))
        cond = Op(DataType.Bool, "lt", (idx[axis], E.size_expr(off + size)))
        res = Op(n.dtype, "select", (cond, L.value(x, local), res))
    return res


def _reshape(L, n, idx):
    x = n.inputs[0]
    src = reshape_index(L.shape(x), L.shape(n), idx)
    return L.value(x, src)


class _Mixed(Exception):
    """A reshape group whose sizes mix symbolic ones: _unravelled takes it."""


def reshape_index(in_shape, out_shape, idx) -> list[Expr]:
    """Input indices of a row-major reshape, grouping dims with equal
    products; quasi-affine where each group's symbolic size leads it, else
    (_unravelled) divided by symbolic sizes."""
    if any(s == 0 for s in list(in_shape) + list(out_shape)):
        return [E.const(0)] * len(in_shape)
    try:
        return _grouped(in_shape, out_shape, idx)
    except _Mixed:
        return _unravelled(in_shape, out_shape, idx)


def _unravels(in_shape, out_shape) -> bool:
    """Whether a reshape's index divides by symbolic sizes at run time (_unravelled)."""
    try:
        _grouped(in_shape, out_shape, loop_nest(out_shape)[1])
    except _Mixed:
        return True
    return False


def _unravelled(in_shape, out_shape, idx) -> list[Expr]:
    """Input indices of a row-major reshape as the output position's linear
    offset unravelled: dims equal at the front map one to one, a static
    tail of equal products is grouped (_grouped), the middle divides by
    products of symbolic sizes ([4, s, e] as [4*s, e] reads (k // s, k % s,
    j)). Such an index is not affine: isl widens the access to the dims'
    extents, and the code divides at run time."""
    lo = 0
    while lo < min(len(in_shape), len(out_shape)) - 1 and in_shape[lo] == out_shape[lo]:
        lo += 1
    hi_in, hi_out = _static_tail(in_shape, out_shape, lo)
    src: list[Expr] = [idx[d] for d in range(lo)] + [E.const(0)] * (len(in_shape) - lo)
    src[hi_in:] = _grouped(in_shape[hi_in:], out_shape[hi_out:], idx[hi_out:]) if hi_in < len(in_shape) else []
    linear: Expr = E.const(0)
    for d in range(lo, hi_out):
        linear = E.iadd(_times_size(linear, out_shape[d]), idx[d])
    stride: Expr = E.const(1)
    for d in reversed(range(lo, hi_in)):
        v = _over_size(linear, stride)
        src[d] = v if d == lo else _modulo_size(v, in_shape[d])
        stride = _times_size(stride, in_shape[d])
    return src


def _static_tail(in_shape, out_shape, lo: int) -> tuple[int, int]:
    """(first input dim, first output dim) of the longest tails after lo of
    static sizes whose products are equal ([s, 256] and [s, 4, 64]: 1, 1)."""
    def tails(shape):
        out, p, d = {1: len(shape)}, 1, len(shape)
        while d - 1 > lo and sz.is_static(shape[d - 1]):
            d, p = d - 1, p * int(shape[d - 1])
            out[p] = d
        return out
    ins, outs = tails(in_shape), tails(out_shape)
    best = max((p for p in ins if p in outs), key=lambda p: (len(in_shape) - ins[p], p))
    return ins[best], outs[best]


def _times_size(e: Expr, s: Size) -> Expr:
    if sz.is_static(s):
        return E.imul(e, int(s))
    if isinstance(e, Const) and e.value in (0, 1):
        return e if e.value == 0 else E.size_expr(s)
    return Op(DataType.Int, "mul", (e, E.size_expr(s)))


def _over_size(e: Expr, k: Expr) -> Expr:
    return E.ifloordiv(e, int(k.value)) if isinstance(k, Const) else Op(DataType.Int, "floordiv", (e, k))


def _modulo_size(e: Expr, s: Size) -> Expr:
    return E.imod(e, int(s)) if sz.is_static(s) else Op(DataType.Int, "mod", (e, E.size_expr(s)))


def _grouped(in_shape, out_shape, idx) -> list[Expr]:
    src: list[Expr] = [E.const(0)] * len(in_shape)
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    i = j = 0
    while i < len(ins) or j < len(outs):
        gi, gj = [ins[i]] if i < len(ins) else [], [outs[j]] if j < len(outs) else []
        i, j = i + len(gi), j + len(gj)
        if not gi or not gj:
            raise DefinitionError(f"reshape from {list(in_shape)} to {list(out_shape)} is inconsistent")
        if in_shape[gi[0]] == out_shape[gj[0]]:
            src[gi[0]] = idx[gj[0]]
            continue
        (ci, si), (cj, sj) = _split_size(in_shape[gi[0]]), _split_size(out_shape[gj[0]])
        while (ci, si) != (cj, sj):
            if si != sj:
                raise _Mixed()
            side, shape, dims, k = (gi, in_shape, ins, i) if ci < cj else (gj, out_shape, outs, j)
            if k >= len(dims) or isinstance(shape[dims[k]], Lin):
                raise _Mixed()
            side.append(dims[k])
            if ci < cj:
                ci *= int(in_shape[ins[i]]); i += 1
            else:
                cj *= int(out_shape[outs[j]]); j += 1
        linear: Expr = idx[gj[0]]  # the group's row-major position: only its leading size may be symbolic
        for d in gj[1:]:
            linear = E.iadd(E.imul(linear, int(out_shape[d])), idx[d])
        inner = 1
        for d in reversed(gi):
            v = E.ifloordiv(linear, inner)
            src[d] = v if d == gi[0] else E.imod(v, int(in_shape[d]))
            if d != gi[0]:
                inner *= int(in_shape[d])
    return src


def _split_size(s) -> tuple[int, Any]:
    """A size as (static factor, symbolic factor): 8*s -> (8, s), 2*q + 2 -> (2, q + 1), 6 -> (6, None)."""
    if not isinstance(s, Lin):
        return int(s), None
    k = math.gcd(s.const, *(c for _, c in s.terms))
    return k, s // k


def _position(L, index: Node, at, size) -> Expr:
    """An index value as a safe int64 position: negatives wrap, then clamp."""
    pos = _in_range(L, index, at, size)
    wrapped = Op(DataType.Int, "select", (Op(DataType.Bool, "lt", (pos, E.const(0))),
                                          E.iadd(pos, E.size_expr(size)), pos))
    return E.iclamp(wrapped, E.const(0), E.size_expr(size - 1))


def _gather(L, n, idx):
    x, index = n.inputs
    axis = n.attrs["axis"]
    size = L.shape(x)[axis]
    position = _in_range if n.attrs.get("in_range") else _position
    if n.attrs["along"]:
        src = list(idx)
        src[axis] = position(L, index, idx, size)
        return L.value(x, src)
    k = index.rank
    return L.value(x, list(idx[:axis]) + [position(L, index, idx[axis:axis + k], size)] + list(idx[axis + k:]))


def from_positions(n: Node, memo: dict[int, bool]) -> bool:
    """Whether n is computed from positions and constants alone (no array
    read); memo: the answers so far, by node id."""
    if n.id not in memo:
        memo[n.id] = not n.is_source and all(from_positions(i, memo) for i in n.inputs)
    return memo[n.id]


def _in_range(L, index: Node, at, size) -> Expr:
    """An index value that tabled_positions already made safe, as int64."""
    raw = L.value(index, at)
    return Op(DataType.Int, "cast", (raw,)) if raw.dtype != DataType.Int else raw


def tabled_positions(graph: Graph) -> Graph:
    """A copy in which a gather whose index is computed from positions alone
    and has fewer elements than the gather selects (an upsampling's rows or
    columns) reads that index already wrapped and clamped into the array
    (attr in_range). The lowering makes such an index a table, once
    (Lowering.read_weight), so the wrap and the clamp then run once an entry
    instead of once an element it selects: in bilinear upsampling they were
    a quarter of the time (bench/NOTES.md)."""
    positional: dict[int, bool] = {}

    def step(old: Node, n: Node, new: dict[int, Node]) -> Node:
        if n.op != "gather" or n.attrs.get("in_range"):
            return n
        x, index = n.inputs
        size, selected, entries = x.shape[n.attrs["axis"]], sz.static_product(n.shape), sz.static_product(index.shape)
        if not (sz.is_static(size) and selected and entries and entries < selected
                and from_positions(old.inputs[1], positional)):
            return n
        changed.append(n)
        return replace(n, inputs=(x, _safe_position(graph, index, int(size))), attrs={**n.attrs, "in_range": True})
    changed: list[Node] = []
    graph = graph.rewritten(step)
    return graph.deduplicated() if changed else graph  # (two gathers at one index share its table)


def _safe_position(graph: Graph, index: Node, size: int) -> Node:
    """index as _position computes it per element, as graph nodes."""
    i64 = DataType.Int
    pos = graph.cast(index, i64)
    wrapped = graph.where(graph.binary("lt", pos, graph.constant(0, i64)),
                          graph.binary("add", pos, graph.constant(size, i64)), pos)
    return graph.binary("minimum", graph.binary("maximum", wrapped, graph.constant(0, i64)),
                        graph.constant(size - 1, i64))


def _linear(shape, idx, offset: int = 0) -> Expr:
    """The row-major position of element idx, plus offset."""
    linear: Expr = E.const(offset)
    stride: Expr = E.const(1)
    for d in reversed(range(len(shape))):
        linear = E.iadd(linear, E.imul(idx[d], stride))
        stride = E.imul(E.size_expr(shape[d]), stride) if not isinstance(stride, Const) or \
            not sz.is_static(shape[d]) else E.const(stride.value * int(shape[d]))
    return linear


def _random_bits(L, n, idx):
    key = [L.value(n.inputs[0], (E.const(k),)) for k in (0, 1)]
    word = n.attrs.get("word")
    return Op(DataType.UInt32, "threefry" if word is None else f"threefry{word}",
              (key[0], key[1], _linear(L.shape(n), idx, n.attrs.get("offset", 0))))


def _philox_bits(L, n, idx):
    key = L.value(n.inputs[0], (E.const(0),))
    counter = [L.value(n.inputs[1], (E.const(k),)) for k in (0, 1)]
    return Op(DataType.UInt32, "philox", (key, *counter, _linear(L.shape(n), idx)))


def _bitcast(L, n, idx):
    return Op(n.dtype, "bitcast", (L.value(n.inputs[0], idx),))


def _rand(L, n, idx):
    linear = _linear(L.shape(n), idx, n.attrs["offset"])
    seed = L.value(n.inputs[0], ())
    seed = Op(DataType.Int, "cast", (seed,)) if seed.dtype != DataType.Int else seed
    u = Op(DataType.Float, "rand", (seed, linear))
    return u if n.dtype == DataType.Float else Op(n.dtype, "cast", (u,))


INLINE: dict[str, Callable] = {op: _elementwise for op in UNARY_OPS + BINARY_OPS}
INLINE.update({"where": _where, "cast": _cast, "constant": _constant, "size": _size, "iota": _iota,
               "broadcast_in_dim": _broadcast, "transpose": _transpose, "slice": _slice,
               "reverse": _reverse, "pad": _pad, "concatenate": _concatenate,
               "reshape": _reshape, "gather": _gather, "rand_uniform": _rand, "random_bits": _random_bits,
               "philox_bits": _philox_bits, "bitcast": _bitcast})
LAYOUT_OPS = ("broadcast_in_dim", "transpose", "slice", "reverse", "reshape", "iota",
              "constant", "size")
VIEWS = ("reshape",)  # layout ops whose result is the operand's array as it lies (an output may alias it)
SCATTERED_READS = {"gather": 0}  # op -> the operand it reads at data-dependent positions, often many times


# ================================================== reduction-shaped ops
def _reduce(L: Lowering, n: Node) -> ReductionSpec:
    x = n.inputs[0]
    axes, keep = n.attrs["axes"], n.attrs["keepdim"]
    xs = L.shape(x)

    def term(o, r):
        src, k, j = [], 0, 0
        for d in range(x.rank):
            if d in axes:
                src.append(r[k]); k += 1
                if keep:
                    j += 1
            else:
                src.append(o[j]); j += 1
        return L.value(x, src)
    return ReductionSpec([xs[d] for d in axes], term, n.attrs["op"], reads_once=True)


def _dot(L: Lowering, n: Node) -> ReductionSpec:
    a, b = n.inputs
    at = n.attrs
    lf, rf = free_dims(n)
    nb = len(at["lb"])

    def term(o, r):
        ia, ib = [None] * a.rank, [None] * b.rank
        for k, (i, j) in enumerate(zip(at["lb"], at["rb"])):
            ia[i] = ib[j] = o[k]
        for k, d in enumerate(lf):
            ia[d] = o[nb + k]
        for k, d in enumerate(rf):
            ib[d] = o[nb + len(lf) + k]
        for k, (i, j) in enumerate(zip(at["lc"], at["rc"])):
            ia[i] = ib[j] = r[k]
        return Op(n.dtype, "mul", (L.value(a, ia), L.value(b, ib)))
    return ReductionSpec([L.shape(a)[d] for d in at["lc"]], term, "sum")


def _conv(L: Lowering, n: Node) -> ReductionSpec:
    x, w = n.inputs
    at = n.attrs
    lay, klay, groups = at["layout"], at["kernel_layout"], at["groups"]
    sp = [c for c in lay if c not in "NC"]
    wshape = L.shape(w)
    cin_g = wshape[klay.index("I")]
    cout = wshape[klay.index("O")]
    ksz = [wshape[klay.index(c)] for c in sp]
    if groups > 1 and not sz.is_static(cout):
        raise DefinitionError("conv: grouped convolution needs a static number of output channels")
    cout_g = cout // groups if groups > 1 else cout

    # the reduction runs over the kernel's dimensions in its memory order
    # (HWIO: window then channels), so the innermost one walks memory
    red = [c for c in klay if c != "O"]

    def term(o, r):
        rv = dict(zip(red, r))
        co = o[lay.index("C")]
        ci = rv["I"]
        if groups > 1:
            ci = E.iadd(E.imul(E.ifloordiv(co, cout_g), cin_g), rv["I"])
        xi = conv_input_index(L, n, o[lay.index("N")], ci, [o[lay.index(c)] for c in sp], [rv[c] for c in sp])
        wi = [None] * w.rank
        wi[klay.index("O")] = co
        wi[klay.index("I")] = rv["I"]
        for c in sp:
            wi[klay.index(c)] = rv[c]
        xv = guarded(L, x, xi, E.const(0.0 if n.dtype.is_float else 0, n.dtype),
                     [lay.index(c) for k, c in enumerate(sp) if any(at["padding"][k])])
        return Op(n.dtype, "mul", (xv, L.value(w, wi)))
    # reading one input channel per output channel (depthwise), it is a stencil:
    # unrolled, its taps are loads along the output's own loops (vectors along
    # channels in NHWC), where the contraction's register blocks, made for reuse
    # across output channels, find none (a 5x5 NHWC depthwise convolution ran
    # 3-6x slower as a contraction)
    depthwise = w.shape[klay.index("I")] == 1
    return ReductionSpec([cin_g if c == "I" else ksz[sp.index(c)] for c in red], term, "sum",
                         unroll=STENCIL_UNROLL_LIMIT if depthwise else UNROLL_LIMIT)


def conv_input_index(L: Lowering, n: Node, batch: Expr, channel: Expr, out, window) -> list:
    """The input element convolution n reads for an output position (out,
    per spatial dimension) and kernel tap (window), unguarded."""
    at, lay = n.attrs, n.attrs["layout"]
    xi: list = [None] * n.inputs[0].rank
    xi[lay.index("N")] = batch
    xi[lay.index("C")] = channel
    for k, c in enumerate(c for c in lay if c not in "NC"):
        xi[lay.index(c)] = E.iadd(E.imul(out[k], at["strides"][k]),
                                  E.isub(E.imul(window[k], at["dilation"][k]), E.const(at["padding"][k][0])))
    return xi


def _reduce_window(L: Lowering, n: Node) -> ReductionSpec:
    x = n.inputs[0]
    at = n.attrs
    fill = identity(at["op"], n.dtype)

    def term(o, r):
        src = [E.iadd(E.imul(o[d], at["strides"][d]),
                      E.isub(E.imul(r[d], at["dilation"][d]), E.const(at["padding"][d][0])))
               for d in range(x.rank)]
        return guarded(L, x, src, fill, [d for d in range(x.rank) if any(at["padding"][d])])
    # windows that do not overlap (a 2x2 pooling at stride 2) read each element once: its
    # producer (a batch norm and relu) is computed in the window's terms, not stored for them
    apart = all(w == 1 or (w - 1) * dl < st for w, dl, st in zip(at["window"], at["dilation"], at["strides"]))
    return ReductionSpec(list(at["window"]), term, at["op"], reads_once=apart)


REDUCTIONS: dict[str, Callable[[Lowering, Node], ReductionSpec]] = {
    "reduce": _reduce, "dot_general": _dot, "conv": _conv, "reduce_window": _reduce_window}


# ======================================================= statement ops
def _cumulative(L: Lowering, n: Node, name):
    """A first-order recurrence: out[i] = out[i-1] (op) x[i], one statement."""
    axis, op = n.attrs["axis"], n.attrs["op"]
    iters, idx, bounds = loop_nest(L.shape(n))
    prev = list(idx)
    prev[axis] = Op(DataType.Int, "max", (E.isub(idx[axis], E.const(1)), E.const(0)))
    first = Op(DataType.Bool, "gt", (idx[axis], E.const(0)))
    carry = Op(n.dtype, "select", (first, Load(n.dtype, name, tuple(prev)), identity(op, n.dtype)))
    L.add(name, iters, bounds, idx, Op(n.dtype, scalar.CUMULATIVE[op], (carry, L.value(n.inputs[0], idx))),
          "cumulative")


def scatter_base(n: Node) -> Node | None:
    """The value scatter n combines into (graph.scatter's base), or None: into its op's identity."""
    return n.inputs[2] if n.op == "scatter" and len(n.inputs) > 2 else None


def _scatter(L: Lowering, n: Node, name):
    index, src = n.inputs[:2]
    axis, op = n.attrs["axis"], n.attrs["op"]
    iters, idx, bounds = loop_nest(L.shape(n))
    base = scatter_base(n)
    if base is None:
        L.add(name, iters, bounds, idx, identity(op, n.dtype), "scatter_init", role=Role.INIT)
    elif L.array_of.get(base.id) != name:  # (else its base is made in place: Lowering.scatters_in_place)
        L.add(name, iters, bounds, idx, L.value(base, idx), "scatter_init", role=Role.INIT)
    siters, sidx, sbounds = loop_nest(L.shape(index) if n.attrs["along"] else L.shape(src), "j")
    size = L.shape(n)[axis]
    if n.attrs["along"]:
        target = list(sidx)
        target[axis] = _position(L, index, sidx, size)
    else:
        k = index.rank
        target = list(sidx[:axis]) + [_position(L, index, sidx[axis:axis + k], size)] + list(sidx[axis + k:])
    L.add(name, siters, sbounds, target, L.value(src, sidx),
          "scatter_add" if op == "sum" else "scatter", combine=op, reduction_iters=siters, role=Role.UPDATE)


STATEMENT_OPS: dict[str, Callable] = {"cumulative": _cumulative, "scatter": _scatter}


def _read_in_place(nodes: list[Node], library: set[int]) -> set[int]:
    """The packed copies (targets.cpu.packed_operands) whose every reader is a library call."""
    readers: dict[int, set[int]] = {}
    for n in nodes:
        for i in n.inputs:
            readers.setdefault(i.id, set()).add(n.id)
    return {n.id for n in nodes if n.attrs.get("packed") and readers.get(n.id) and readers[n.id] <= library}
