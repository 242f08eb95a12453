"""FusionDefinition: build a program op by op, as with nvFuser.

Definitions live in a process-wide registry, as nvFuser's fusion cache: a
definition gets its id when its ``with`` block ends (or at ``fd.id()``);
structurally equal definitions (equal canonical forms, see
:func:`polyjit.printing.canonical`) share one id and one compiled program,
and ``FusionDefinition(fid)`` is that definition again, ready to execute.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from . import interop, printing
from . import ops as _ops
from .api import Executable
from .dtypes import DataType, to_dtype
from .errors import DefinitionError
from .graph import Graph
from .options import CompileOptions, parse_options
from .sizes import Lin


class _OperatorsMeta(type):
    def __dir__(cls):
        return sorted(_ops.__all__)


@dataclass
class _Entry:
    """A registered definition: its graph, which inputs take Python numbers,
    and its executables (one per set of compile options)."""

    id: int
    graph: Graph
    scalars: tuple[int, ...]
    exes: dict = field(default_factory=dict)


class _Registry:
    def __init__(self) -> None:
        self.by_form: dict[str, _Entry] = {}
        self.by_id: list[_Entry] = []
        self.lock = threading.Lock()

    def add(self, graph: Graph, scalars: Sequence[int]) -> _Entry:
        form = printing.canonical(graph, scalars)
        with self.lock:
            entry = self.by_form.get(form)
            if entry is None:
                g = copy.copy(graph)  # later definitions on the caller's graph leave this one as it is
                g.inputs, g.outputs = list(graph.inputs), list(graph.outputs)
                g.aliases, g.constraints = dict(graph.aliases), list(graph.constraints)
                entry = self.by_form[form] = _Entry(len(self.by_id), g, tuple(scalars))
                self.by_id.append(entry)
            return entry

    def get(self, fid: int) -> _Entry:
        with self.lock:
            if not 0 <= fid < len(self.by_id):
                known = f"ids 0 to {len(self.by_id) - 1}" if self.by_id else "none"
                raise DefinitionError(f"FusionDefinition({fid}): no definition has id {fid} in this process "
                                      f"(known: {known}); define it first, then pass fd.id()")
            return self.by_id[fid]


_registry = _Registry()


class FusionDefinition:
    """A program under definition: ``with FusionDefinition() as fd: ...``.

    ``fd.ops`` holds the core op set and the composites; ``fd.execute(inputs)``
    compiles on first use and runs; ``fd.stats`` reports what the compiler did.
    ``FusionDefinition(fid)`` is the registered definition ``fid`` (``fd.id()``).
    """

    class Operators(metaclass=_OperatorsMeta):
        """Every op a definition can use (see polyjit.ops for each one's doc)."""

    for _name in _ops.__all__:
        setattr(Operators, _name, staticmethod(getattr(_ops, _name)))
    del _name

    def __init__(self, id: int | Mapping | CompileOptions | None = None,
                 compile_options: Mapping | CompileOptions | None = None) -> None:
        if isinstance(id, (Mapping, CompileOptions)) and compile_options is None:
            id, compile_options = None, id  # FusionDefinition(compile_options) as before
        self.ops = FusionDefinition.Operators
        self.options = parse_options(compile_options)
        self._entry: _Entry | None = None
        self._named: dict[str, Lin] = {}  # define_tensor's named sizes
        if id is None:
            self.graph = Graph()
            self._scalars: list[int] = []
        elif isinstance(id, int) and not isinstance(id, bool):
            self._entry = _registry.get(id)
            self.graph, self._scalars = self._entry.graph, list(self._entry.scalars)
        else:
            raise DefinitionError(f"FusionDefinition's first argument is a {type(id).__name__}; expected a "
                                  "definition id (an int from fd.id()), compile options (a dict) or nothing")
        self._fixed = id is not None

    def __enter__(self) -> "FusionDefinition":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and self.graph.outputs:
            self._register()

    def _changing(self, what: str) -> None:
        if self._fixed:
            raise DefinitionError(f"{what}: FusionDefinition({self._entry.id}) is a registered definition and "
                                  "cannot change; start a new one with FusionDefinition()")
        self._entry = None

    def _register(self) -> _Entry:
        if self._entry is None:
            if not self.graph.outputs:
                raise DefinitionError("the definition has no outputs: call fd.add_output")
            self._entry = _registry.add(self.graph, self._scalars)
        return self._entry

    def id(self) -> int:
        """This definition's id in the process: equal definitions have one id."""
        return self._register().id

    # ------------------------------------------------------------ inputs
    def define_tensor(self, ndims: int | None = None, symbolic_sizes: Sequence | None = None,
                      contiguous: Sequence[bool] | None = None, dtype=DataType.Float,
                      sizes: Sequence[int] | None = None, strides: Sequence[int] | None = None,
                      shape: Sequence | None = None, contiguity=None) -> _ops.Tensor:
        """A tensor input: -1 sizes are symbolic (any size), 1 broadcasts; a
        name (``"n"``) is a symbolic size that every dimension with that name
        has, and an earlier input's size (``T0.shape[1]``) that size again."""
        self._changing("define_tensor")
        sym = symbolic_sizes if symbolic_sizes is not None else shape
        if sizes is not None:
            dims = list(sizes)
        elif sym is not None:
            dims = list(sym)
        elif ndims is not None:
            dims = [-1] * ndims
        else:
            raise DefinitionError("define_tensor needs ndims, symbolic_sizes, shape or sizes")
        k = len(self.graph.inputs)
        sizes_ = tuple(s if isinstance(s, Lin) else self._named.setdefault(s, Lin.param(f"T{k}_{d}"))
                       if isinstance(s, str) else Lin.param(f"T{k}_{d}") if s == -1 else int(s)
                       for d, s in enumerate(dims))
        for d, s in enumerate(sizes_):
            if not isinstance(s, Lin) and s < 0:
                raise DefinitionError(f"define_tensor: size {s} in dimension {d}; use -1 for a symbolic size")
        contig = contiguous if contiguous is not None else contiguity
        strided = contig is not None and not all(c in (True, None) for c in contig)
        if strides is not None and sizes is not None:
            expect = list(np.cumprod([1] + list(sizes[::-1]))[:-1][::-1])
            strided = strided or [int(s) for s in strides] != [int(e) for e in expect]
        n = self.graph.input(sizes_, to_dtype(dtype), f"T{k}", strided)
        n.attrs["declared_strided"] = strided
        return _ops.Tensor(self.graph, n)

    def define_scalar(self, value=None, dtype=None) -> _ops.Tensor:
        """A scalar input when value is None (of dtype, default Double), else a
        constant that, like a Python number, takes the other operand's type
        (``mul(float32 tensor, define_scalar(3.0))`` is float32)."""
        if value is not None:
            t = self.define_constant(value, dtype)
            if t.node.is_constant:
                t.node.attrs["weak"] = True
            return t
        self._changing("define_scalar")
        k = len(self.graph.inputs)
        n = self.graph.input((), to_dtype(dtype or DataType.Double), f"S{k}")
        n.attrs["declared_strided"] = False
        self._scalars.append(k)
        return _ops.Tensor(self.graph, n)

    def define_constant(self, value, dtype=None) -> _ops.Tensor:
        """A constant: a number (of dtype), an array (numpy, or any framework's
        host array) or a size (``T0.shape[0]``, an int64 scalar)."""
        if isinstance(value, Lin):
            return _ops.Tensor(self.graph, self.graph.size_value(value))
        if isinstance(value, (bool, int, float, np.generic)):
            return _ops.Tensor(self.graph, self.graph.constant(value, to_dtype(dtype) if dtype else None))
        arr = interop.host_array(value, "define_constant's value")
        return _ops.Tensor(self.graph, self.graph.tensor_constant(arr if dtype is None else arr.astype(
            to_dtype(dtype).numpy)))

    def add_output(self, t: _ops.Tensor) -> None:
        self._changing("add_output")
        if not isinstance(t, _ops.Tensor) or t.graph is not self.graph:
            raise DefinitionError("add_output takes a Tensor of this definition")
        self.graph.add_output(t.node)

    # --------------------------------------------------------------- run
    def executable(self) -> Executable:
        """The registered definition's program for these compile options
        (shared by every equal definition)."""
        entry = self._register()
        exe = entry.exes.get(self.options)
        if exe is None:
            exe = entry.exes.setdefault(self.options, Executable(entry.graph, self.options, f"fusion{entry.id}",
                                                                  entry.scalars))
        return exe

    def execute(self, inputs: Sequence, compile_options: Mapping | None = None) -> list:
        """Run on ``inputs`` (numpy arrays, torch tensors, JAX arrays, arrays
        with __dlpack__ or __cuda_array_interface__, Python numbers for
        scalars): the results are of the inputs' kind, on their device."""
        if compile_options is not None:
            self.options = parse_options(compile_options)
        exe = self.executable()
        call = interop.Call(inputs, exe.name)
        return call.results(exe(*call.arrays, **call.launch))

    @property
    def stats(self) -> dict:
        return self.executable().stats

    def print_ir(self, file=None) -> None:
        self.executable().print_ir(file)

    def print(self, file=None) -> None:
        """The definition as a Python function, and the ``with`` block that
        defines it again (run it to rebuild an equal definition)."""
        print(self.to_python(), file=file)

    def to_python(self) -> str:
        name = f"fusion{self._entry.id}" if self._entry is not None else "fusion"
        return printing.python_definition(self.graph, self._scalars, name)

    def canonical(self) -> str:
        """The structure that decides equality (and the id)."""
        return printing.canonical(self.graph, self._scalars)

    __str__ = to_python
