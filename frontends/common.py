"""What every frontend shares: compile stats, the fallback rule (counted,
warned once per op, refused under ``strict``), and programs of framework
ops run as polyjit-compiled segments with the framework's own ops between
them. Imports no framework."""
from __future__ import annotations

import itertools
import types
import warnings
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np

from polyjit import ops
from polyjit.api import Executable, takes_device_arrays
from polyjit.dtypes import DataType
from polyjit.errors import CompileOptionError, DeviceError, InputError, UnsupportedOpError
from polyjit.graph import Graph, Node
from polyjit.options import CompileOptions
from polyjit.runtime.gpu_buffers import GpuView
from polyjit.sizes import Lin

_warned: set = set()
USER_ERRORS = (InputError, CompileOptionError, DeviceError)  # what a fallback must not hide

# What each decorator's execution_backend may name besides polyjit: the
# framework without a compiler, and its own compiler, to compare against.
EXECUTION_BACKENDS = {"torch": ("polyjit", "std", "inductor"), "jax": ("polyjit", "std", "xla"),
                      "tf": ("polyjit", "std", "xla")}


def function_text(fn: Callable) -> str | None:
    """A Python function as text that is the same in every process that
    defines it alike: its code and its wrappers' (``__wrapped__``), nested
    code included; None where it has no code of its own (a partial, a
    callable object). For a compile cache mark (compiler.expect_compile):
    what the function closes over is not in it, as the mark is only a
    guess that its programs are in the cache."""
    parts = []
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType):
            return None
        parts.append(f"{getattr(fn, '__module__', '')} {_code_text(code)}")
        fn = getattr(fn, "__wrapped__", None)
    return "\n".join(parts)


def trace_text(options: CompileOptions, signature: tuple, body: str | None) -> str | None:
    """What a frontend is about to trace (``body``: its code, dynamo's graph
    or function_text; ``signature``: the framework's version, the arguments'
    shapes and dtypes), for a compile cache mark (compiler.expect_compile);
    None where the cache is off or there is no body."""
    return f"{options.key()!r} {signature!r}\n{body}" if options.cache and body else None


def _code_text(code: types.CodeType) -> str:
    consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(sorted(c, key=repr))
              if isinstance(c, frozenset) else repr(c) for c in code.co_consts]  # (a set's order varies by process)
    return f"{getattr(code, 'co_qualname', code.co_name)} {code.co_code.hex()} {code.co_names} {consts}"


def check_execution_backend(framework: str, value: str) -> None:
    allowed = EXECUTION_BACKENDS[framework]
    if value not in allowed:
        raise CompileOptionError(f"execution_backend is {value!r}; allowed values: {list(allowed)}")

_DTYPES = {"float32": DataType.Float, "float64": DataType.Double, "float16": DataType.Half,
           "bfloat16": DataType.BFloat16, "int8": DataType.Int8, "uint8": DataType.UInt8, "int16": DataType.Int16,
           "int32": DataType.Int32, "uint32": DataType.UInt32, "int64": DataType.Int, "uint64": DataType.UInt64,
           "bool": DataType.Bool}


def core_dtype(dt) -> DataType:
    """The core dtype of a numpy, JAX or TensorFlow dtype (by name), or UnsupportedOpError."""
    name = getattr(dt, "name", str(dt))
    if name not in _DTYPES:
        raise UnsupportedOpError(f"dtype {name}")
    return _DTYPES[name]


@dataclass(eq=False)
class Stats(Mapping):
    """What polyjit did for one decorated function, summed over its graphs
    (``contractions``: each contraction's library-or-generated choice, and why);
    reads as a dict (``stats["fallbacks"]``) that stays current."""

    graphs: dict = field(default_factory=dict)
    fallbacks: int = 0
    fallback_ops: set = field(default_factory=set)

    def record(self, name: str, stats: dict) -> None:
        """Keep a graph's live stats (the dict its program updates at each call)."""
        self.graphs[name] = stats

    def as_dict(self) -> dict:
        out = {"graphs": len(self.graphs), "fallbacks": self.fallbacks,
               "fallback_ops": sorted(self.fallback_ops)}
        for key in ("kernels", "statements", "fused", "inlined", "contracted_buffers", "intermediate_bytes",
                    "library_calls", "fusions_refused", "folded", "cache_hits", "kernels_compiled", "launchers_compiled"):
            out[key] = sum(s.get(key, 0) for s in self.graphs.values())
        out["contractions"] = [c for s in self.graphs.values() for c in s.get("contractions", ())]
        return out

    def __getitem__(self, key: str):
        return self.as_dict()[key]

    def __iter__(self):
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def __repr__(self) -> str:
        return repr(self.as_dict())


def fallback(stats: Stats, op: str, framework: str, where: str = "", strict: bool = False) -> None:
    """Record that `op` runs in the framework instead of polyjit (raise under strict)."""
    at = f" (at {where})" if where else ""
    if strict:
        raise UnsupportedOpError(f"{op} is not supported by polyjit{at}")
    stats.fallbacks += 1
    stats.fallback_ops.add(op)
    if op not in _warned:
        _warned.add(op)
        warnings.warn(f"polyjit: {op} runs in {framework}{at}", stacklevel=3)


def internal_failure(stats: Stats, what: str, err: Exception, framework: str, strict: bool = False) -> None:
    """``what`` could not be compiled: an op polyjit refuses (UnsupportedOpError)
    or a failure inside polyjit. Either is a counted fallback, warned once,
    so that the user's program runs on; raised under strict. The user's own
    errors (bad input, bad option, no device) always raise."""
    if strict or isinstance(err, USER_ERRORS):
        raise err
    fallback(stats, str(err) if isinstance(err, UnsupportedOpError) else f"{what} ({type(err).__name__}: {err})",
             framework)


# ====================================================== segmented programs
class Value:
    """A value of a framework program: its shape (a None size, or a None shape:
    known only at run time) and framework dtype."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype) -> None:
        self.shape, self.dtype = (tuple(shape) if shape is not None else None), dtype


@dataclass
class Const:
    """A value known at compile time (a literal, a captured array)."""

    value: np.ndarray


@dataclass(eq=False)
class KnownSizes:
    """A small integer tensor known at compile time element by element (a
    shape whose dims are symbolic, and arithmetic on it): each element a
    number or a size (:class:`~polyjit.sizes.Lin`) over parameters that
    stand for dims of program values. An op that takes a shape (a
    reshape's) gets the elements as sizes of its own graph, so that one
    program serves every size; an op run in the framework gets the array,
    computed from the shapes of the call's arrays."""

    value: np.ndarray  # dtype object: ints and Lin
    dims: dict[str, tuple[Value, int]]  # parameter -> the dim it stands for
    dtype: np.dtype

    def sizes(self, dim: Callable[[Value, int], Any]) -> np.ndarray:
        """The elements with each parameter's dim given by ``dim(value, d)``:
        sizes of a graph (Lin.evaluate over sizes substitutes them, products
        and quotients of parameters remade from their factors), or numbers."""
        env = {p: dim(v, d) for p, (v, d) in self.dims.items()}
        out = np.empty(self.value.shape, object)
        for k, e in np.ndenumerate(self.value):
            out[k] = e.evaluate(env) if isinstance(e, Lin) else int(e)
        return out

    def array(self, values: dict) -> np.ndarray:
        """The value at run time, from the shapes of the arrays in ``values``."""
        return self.sizes(lambda v, d: int(values[id(v)].shape[d])).astype(self.dtype)


def operand_values(ins: Sequence) -> list:
    """An op's operands with each :class:`KnownSizes` replaced by the values
    whose dims it reads (what must be live, and at hand, where it runs)."""
    out = []
    for x in ins:
        if isinstance(x, KnownSizes):
            out.extend(v for v, _ in x.dims.values())
        else:
            out.append(x)
    return out


@dataclass
class Op:
    """One framework op: ``rule(params, *operands)`` translates it, as torch's
    rules do: its operands as :class:`polyjit.ops.Tensor` (compile-time values
    too, which :func:`static_value` reads), its result a Tensor or a list of
    them; an op without operands (an iota) gets ``like=``, a Tensor of the
    graph, as ``ops.iota`` takes it; a :class:`KnownSizes` operand comes as
    a tuple of sizes (a scalar: one size). The rule raises
    UnsupportedOpError for arguments it refuses; None: not in the table.
    ``run(values)`` executes the op in the framework instead. ``loop``: a
    while loop whose condition and body compile as programs of their own
    (run by the host, an iteration at a time)."""

    name: str
    rule: Callable | None
    params: Any
    ins: list  # Value | Const | KnownSizes
    outs: list  # Value
    run: Callable[[list], list]
    where: str = ""
    loop: "WhileLoop | None" = None
    effects: bool = False  # what it does besides its results (a variable's update, a callback): never dropped


def framework_ops_first(ops: list[Op]) -> list[Op]:
    """ops with those the framework runs (no rule), and what they read, moved
    ahead of the rest, and among those the compiled ones taken together
    wherever their operands allow (ops with effects keep their order): a
    model's dropouts (TensorFlow's stateless Philox, each from the seed
    variable plus a count) then split the compiled program once, not at
    every layer."""
    producer = {id(v): i for i, op in enumerate(ops) for v in op.outs}
    early: set[int] = set()
    for i, op in enumerate(ops):
        if op.rule is None and op.loop is None:
            stack = [i]
            while stack:
                j = stack.pop()
                if j not in early:
                    early.add(j)
                    stack.extend(producer[id(x)] for x in operand_values(ops[j].ins) if id(x) in producer)
    if not early or len(early) == len(ops):
        return ops
    first, done = [], set()
    left = sorted(early)
    compiled = True
    while left:
        waiting = []
        for j in left:
            op = ops[j]
            ready = all(producer.get(id(x)) in done or producer.get(id(x)) not in early
                        for x in operand_values(op.ins))
            effects_before = any(ops[k].effects for k in waiting)
            if ready and (op.rule is not None) == compiled and not (op.effects and effects_before):
                first.append(op)
                done.add(j)
            else:
                waiting.append(j)
        left, compiled = waiting, not compiled
    return first + [op for i, op in enumerate(ops) if i not in early]


def live(ops: list[Op], outvars: list) -> list[Op]:
    """The ops whose results are used (an output, or an operand of a live
    op), and those with effects: an op whose results nothing reads (shape
    arithmetic a folded reshape no longer needs, flax's RNN splitting a key
    for a carry it fills with zeros) is neither compiled nor run."""
    used = {id(v) for v in outvars}
    keep = []
    for op in reversed(ops):
        if op.effects or not op.outs or any(id(v) in used for v in op.outs):
            keep.append(op)
            used.update(id(x) for x in operand_values(op.ins))
    return keep[::-1]


@dataclass
class WhileLoop:
    """A while loop's parts, each (invars, ops, outvars): the condition takes
    its constants and the carried values and gives one boolean; the body
    takes its constants and the carried values and gives them anew. The
    op's operands are the condition's constants, the body's, then the
    initial carried values."""

    cond: tuple
    body: tuple
    cond_consts: int
    body_consts: int


def elementwise(name: str) -> Callable:
    """The rule of a framework op that is the core elementwise op ``name``."""
    fn = getattr(ops, name)
    return lambda params, *xs: fn(*xs)


def logical(name: str) -> Callable:
    """The rule of and/or/xor/not: logical on booleans, on the bits of integers
    (the first operand's dtype decides: a scalar operand follows it)."""
    logical_op, bits_op = getattr(ops, "logical_" + name), getattr(ops, "bitwise_" + name)
    return lambda params, *xs: (logical_op if xs[0].dtype == DataType.Bool else bits_op)(*xs)


def identity(params, *xs):
    """The rule of an op that passes its operands through (Identity, stop_gradient)."""
    return xs[0] if len(xs) == 1 else list(xs)


def static_value(x: ops.Tensor | Node) -> np.ndarray:
    """The value of a tensor known at compile time, or UnsupportedOpError."""
    n = x.node if isinstance(x, ops.Tensor) else x
    if n.is_constant:
        return np.asarray(n.attrs["value"])
    if n.op == "tensor_constant":
        return n.attrs["value"]
    if n.op in ("broadcast_in_dim", "reshape") and all(isinstance(s, int) for s in n.shape):
        v = static_value(n.inputs[0])
        if n.op == "reshape":
            return v.reshape(n.shape)
        shape = [1] * len(n.shape)
        for k, d in enumerate(n.attrs["dims"]):
            shape[d] = v.shape[k]
        return np.broadcast_to(v.reshape(shape), n.shape)
    raise UnsupportedOpError("an operand that must be known at compile time is computed at run time")


class _Segment:
    """A run of supported ops, translated into one polyjit graph."""

    def __init__(self, gpu_view: Callable[[Any], GpuView | None] | None) -> None:
        self.gpu_view = gpu_view
        self.graph = Graph()
        self.env: dict[int, Node] = {}
        self.inputs: list[Value] = []
        self.defined: list[Value] = []
        self.outputs: list[Value] = []
        self.ops: list[Op] = []  # what the framework runs should compiling fail
        self.exe: Executable | None = None
        self.failed = False

    def operand(self, x) -> Node:
        if isinstance(x, Const):
            v = x.value
            dt = core_dtype(v.dtype)
            return self.graph.constant(v.item(), dt) if v.ndim == 0 else self.graph.tensor_constant(v)
        if id(x) not in self.env:
            if x.shape is None:
                raise UnsupportedOpError("an operand of unknown rank")
            k = len(self.inputs)  # an unknown size (None) becomes a symbolic one
            shape = [Lin.param(f"v{k}_{d}") if s is None else s for d, s in enumerate(x.shape)]
            self.env[id(x)] = self.graph.input(shape, core_dtype(x.dtype), f"v{k}")
            self.inputs.append(x)
        return self.env[id(x)]

    def known_sizes(self, x: KnownSizes):
        """x's elements as sizes of this graph: the dims they name read off
        the values' nodes (a value only measured becomes an input too)."""
        sizes = x.sizes(lambda v, d: self.operand(v).shape[d])
        return sizes.item() if sizes.ndim == 0 else tuple(sizes.tolist())

    def anchor(self) -> ops.Tensor:
        """A Tensor of this segment's graph, for rules that make values from nothing."""
        return ops.Tensor(self.graph, self.graph.constant(0))

    def add(self, op: Op) -> None:
        """Translate op, or raise UnsupportedOpError leaving the segment unchanged."""
        n_inputs, graph_inputs = len(self.inputs), len(self.graph.inputs)
        try:
            for v in op.outs:
                core_dtype(v.dtype)
            xs = [self.known_sizes(x) if isinstance(x, KnownSizes) else ops.Tensor(self.graph, self.operand(x))
                  for x in op.ins]
            result = op.rule(op.params, *xs) if xs else op.rule(op.params, like=self.anchor())
            results = list(result) if isinstance(result, (list, tuple)) else [result]
            if len(results) != len(op.outs):
                raise UnsupportedOpError(f"{op.name} with {len(op.outs)} results")
            nodes = []
            for v, t in zip(op.outs, results):
                n = self.graph.cast(t.node, core_dtype(v.dtype))
                if v.shape is not None and (len(n.shape) != len(v.shape) or any(
                        s is not None and s != t for s, t in zip(v.shape, n.shape))):
                    raise UnsupportedOpError(f"{op.name} (translated to shape {list(n.shape)}, "
                                             f"expected {list(v.shape)})")
                nodes.append(n)
        except Exception:
            for x in self.inputs[n_inputs:]:
                del self.env[id(x)]
            del self.inputs[n_inputs:], self.graph.inputs[graph_inputs:]
            raise
        for v, n in zip(op.outs, nodes):
            self.env[id(v)] = n
            self.defined.append(v)
        self.ops.append(op)

    def close(self, live: set[int], options: CompileOptions, name: str, stats: Stats, framework: str) -> None:
        self.stats, self.framework = stats, framework
        self.aliases = []  # (value, the input it is: an identity op's result)
        for v in self.defined:
            n = self.env[id(v)]
            if id(v) not in live:
                continue
            if n.is_input:
                self.aliases.append((v, self.inputs[[i.id for i in self.graph.inputs].index(n.id)]))
            else:
                self.graph.add_output(n)
                self.outputs.append(v)
        # an input no output reads (an identity's, aliased) is not the program's to take
        self.inputs = [self.inputs[k] for k in self.graph.drop_unread_inputs()]
        self.exe = Executable(self.graph, options, name)

    def run(self, values: dict) -> None:
        for v, source in self.aliases:
            values[id(v)] = values[id(source)]
        if not self.outputs:
            return
        if not self.failed:
            try:
                outs = self.exe(*[self._array(values[id(v)]) for v in self.inputs])
            except Exception as err:  # compiling for this layout or device failed inside polyjit
                internal_failure(self.stats, f"segment {self.exe.name}", err, self.framework,
                                 self.exe.options.strict)
                self.failed = True
            else:
                for v, o in zip(self.outputs, outs):
                    values[id(v)] = o
                return
        for op in self.ops:
            _Fallback(op).run(values)

    def _array(self, x):
        """An argument as the compiled code takes it: GPU arrays stay where they
        are (unless the target is the CPU); the rest as numpy."""
        if takes_device_arrays(self.exe.options.target):
            view = self.gpu_view(x) if self.gpu_view is not None else None
            if view is not None:
                return view
            if hasattr(x, "__cuda_array_interface__"):
                return x
        return np.asarray(x)


class _Fallback:
    def __init__(self, op: Op) -> None:
        self.op = op

    def run(self, values: dict) -> None:
        for v, o in zip(self.op.outs, self.op.run(_operands(self.op, values))):
            values[id(v)] = o


def _operands(op: Op, values: dict) -> list:
    return [x.value if isinstance(x, Const) else x.array(values) if isinstance(x, KnownSizes) else values[id(x)]
            for x in op.ins]


class _Loop:
    """A while loop on the host: its condition and body are programs of
    their own, called an iteration at a time (their unsupported ops fall
    back as anywhere). Where the condition's value is not in host memory
    (a GPU array), the framework runs the loop, counted as a fallback."""

    def __init__(self, op: Op, options: CompileOptions, stats: Stats, name: str, framework: str,
                 gpu_view) -> None:
        loop = op.loop
        self.op, self.loop, self.stats, self.framework, self.strict = op, loop, stats, framework, options.strict
        self.cond = SegmentedProgram(*loop.cond, options, stats, f"{name}_cond", framework, gpu_view)
        self.body = SegmentedProgram(*loop.body, options, stats, f"{name}_body", framework, gpu_view)

    def run(self, values: dict) -> None:
        args = _operands(self.op, values)
        nc, nb = self.loop.cond_consts, self.loop.body_consts
        cond_consts, body_consts, carry = args[:nc], args[nc:nc + nb], args[nc + nb:]
        while True:
            more = self.cond(cond_consts + carry)[0]
            if not isinstance(more, (np.ndarray, np.generic, bool)):
                fallback(self.stats, f"{self.op.name} (a condition in device memory)", self.framework, self.op.where,
                         self.strict)
                carry = self.op.run(args)
                break
            if not bool(more):
                break
            carry = self.body(body_consts + carry)
        for v, o in zip(self.op.outs, carry):
            values[id(v)] = o


class SegmentedProgram:
    """A framework program as steps: runs of supported ops compiled by polyjit,
    with the framework running each unsupported op between them."""

    def __init__(self, invars: list[Value], ops: list[Op], outvars: list, options: CompileOptions,
                 stats: Stats, name: str, framework: str,
                 gpu_view: Callable[[Any], GpuView | None] | None = None) -> None:
        """``gpu_view(x)``: the framework's array on a GPU as a view of its memory
        (None where it is not one), for frameworks whose arrays say so faster
        than through ``__cuda_array_interface__``."""
        self.invars, self.outvars, self.stats, self.options = invars, outvars, stats, options
        ops = framework_ops_first(ops)
        last: dict[int, int] = {}
        for i, op in enumerate(ops):
            for x in operand_values(op.ins):
                last[id(x)] = i
        for x in outvars:
            last[id(x)] = len(ops)
        self.steps: list = []
        seg: _Segment | None = None
        count = itertools.count()

        def close(i):
            seg.close({k for k, j in last.items() if j >= i}, options, f"{name}_{next(count)}", stats, framework)
            self.steps.append(seg)

        for i, op in enumerate(ops):
            if op.loop is not None:
                if seg is not None:
                    close(i)
                    seg = None
                self.steps.append(_Loop(op, options, stats, f"{name}_loop{next(count)}", framework, gpu_view))
                continue
            if op.rule is not None:
                seg = seg or _Segment(gpu_view)
                try:
                    seg.add(op)
                    continue
                except USER_ERRORS:
                    raise
                except Exception as err:  # arguments the rule refuses, or a failure of the rule itself
                    if options.strict and not isinstance(err, UnsupportedOpError):
                        raise
                    if options.strict:
                        raise UnsupportedOpError(f"{op.name}: {err}; not supported by polyjit"
                                                 + (f" (at {op.where})" if op.where else "")) from None
                    why = str(err) if isinstance(err, UnsupportedOpError) else f"{type(err).__name__}: {err}"
                    fallback(stats, f"{op.name} ({why})", framework, op.where)
            else:
                fallback(stats, op.name, framework, op.where, options.strict)
            if seg is not None:
                close(i)
                seg = None
            self.steps.append(_Fallback(op))
        if seg is not None:
            close(len(ops))
        self.segments = [s for s in self.steps if isinstance(s, _Segment)]

    def saved_call(self, what: str, target: str) -> tuple[Executable, dict, list]:
        """This program as one executable, compiled for ``target`` and its
        row-major inputs, and how its leaves reach it: ``inputs`` (the leaf
        of each of its inputs) and ``outputs`` (each result: ["output", k],
        ["input", leaf] or ["constant", k]), and the constants;
        SavedExecutableError where the framework would run part of it or no
        op computes (``what``: the function's name)."""
        from polyjit.errors import SavedExecutableError
        rest = [s for s in self.steps if not isinstance(s, _Segment)]
        if rest or any(s.failed for s in self.segments) or len(self.segments) > 1:
            ran = ", ".join(s.op.name for s in rest) or "a segment whose compile failed"
            raise SavedExecutableError(f"{what}: the framework runs part of it ({ran}); only a function polyjit "
                                       "compiles whole can be saved")
        seg = self.segments[0] if self.segments else None
        leaf = {id(v): k for k, v in enumerate(self.invars)}
        sources = {id(v): leaf[id(src)] for v, src in seg.aliases} if seg else {}
        produced = {id(v): k for k, v in enumerate(seg.outputs)} if seg else {}
        outputs, constants = [], []
        for x in self.outvars:
            if isinstance(x, Const):
                outputs.append(["constant", len(constants)])
                constants.append(np.asarray(x.value))
            elif id(x) in produced:
                outputs.append(["output", produced[id(x)]])
            else:
                outputs.append(["input", leaf.get(id(x), sources.get(id(x)))])
        if seg is None or not seg.outputs:
            raise SavedExecutableError(f"{what}: its results are its arguments or constants; there is no program "
                                       "to save")
        seg.exe.variant(tuple(bool(i.attrs.get("strided")) for i in seg.exe.graph.inputs), target)
        return seg.exe, {"inputs": [leaf[id(v)] for v in seg.inputs], "outputs": outputs}, constants

    def __call__(self, args: Sequence) -> list:
        values: dict[int, Any] = {id(v): a for v, a in zip(self.invars, args)}
        for step in self.steps:
            step.run(values)
        for seg in self.segments:
            if seg.outputs:
                self.stats.record(seg.exe.name, seg.exe.stats)
        inputs = {id(v) for v in self.invars}
        return [x.value if isinstance(x, Const) else np.array(values[id(x)]) if id(x) in inputs
                else values[id(x)] for x in self.outvars]
