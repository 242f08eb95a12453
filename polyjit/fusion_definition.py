"""FusionDefinition: build a program op by op, as with nvFuser."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from . import ops as _ops
from .api import Executable
from .dtypes import DataType, to_dtype
from .errors import DefinitionError
from .graph import Graph, Node
from .options import parse_options
from .sizes import Lin


class _OperatorsMeta(type):
    def __dir__(cls):
        return sorted(_ops.__all__)


class FusionDefinition:
    """A program under definition: ``with FusionDefinition() as fd: ...``.

    ``fd.ops`` holds the core op set and the composites; ``fd.execute(inputs)``
    compiles on first use and runs; ``fd.stats`` reports what the compiler did.
    """

    class Operators(metaclass=_OperatorsMeta):
        """Every op a definition can use (see polyjit.ops for each one's doc)."""

    for _name in _ops.__all__:
        setattr(Operators, _name, staticmethod(getattr(_ops, _name)))
    del _name

    def __init__(self, compile_options=None) -> None:
        self.graph = Graph()
        self.ops = FusionDefinition.Operators
        self.options = parse_options(compile_options)
        self._exe: Executable | None = None
        self._scalars: list[int] = []
        self._lines: list[str] = []

    def __enter__(self) -> "FusionDefinition":
        return self

    def __exit__(self, *exc) -> None:
        self._exe = None

    # ------------------------------------------------------------ inputs
    def define_tensor(self, ndims: int | None = None, symbolic_sizes: Sequence[int] | None = None,
                      contiguous: Sequence[bool] | None = None, dtype=DataType.Float,
                      sizes: Sequence[int] | None = None, strides: Sequence[int] | None = None,
                      shape: Sequence[int] | None = None, contiguity=None) -> _ops.Tensor:
        """A tensor input: -1 sizes are symbolic (any size), 1 broadcasts."""
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
        sizes_ = tuple(Lin.param(f"T{k}_{d}") if s == -1 else int(s) for d, s in enumerate(dims))
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
        self._lines.append(f"T{k} = fd.define_tensor(shape={[(-1 if isinstance(s, Lin) else s) for s in sizes_]}, "
                           f"contiguity={[not strided] * len(sizes_)}, dtype={to_dtype(dtype)!r})")
        return _ops.Tensor(self.graph, n)

    def define_scalar(self, value=None, dtype=DataType.Double) -> _ops.Tensor:
        """A scalar input when value is None, else a constant."""
        if value is not None:
            return self.define_constant(value, dtype)
        k = len(self.graph.inputs)
        n = self.graph.input((), to_dtype(dtype), f"S{k}")
        n.attrs["declared_strided"] = False
        self._scalars.append(k)
        self._lines.append(f"S{k} = fd.define_scalar(dtype={to_dtype(dtype)!r})")
        return _ops.Tensor(self.graph, n)

    def define_constant(self, value, dtype=None) -> _ops.Tensor:
        if isinstance(value, np.ndarray):
            return _ops.Tensor(self.graph, self.graph.tensor_constant(value))
        return _ops.Tensor(self.graph, self.graph.constant(value, to_dtype(dtype) if dtype else None))

    def add_output(self, t: _ops.Tensor) -> None:
        if not isinstance(t, _ops.Tensor) or t.graph is not self.graph:
            raise DefinitionError("add_output takes a Tensor of this definition")
        self.graph.add_output(t.node)
        self._exe = None

    # --------------------------------------------------------------- run
    def executable(self) -> Executable:
        if self._exe is None:
            if not self.graph.outputs:
                raise DefinitionError("the definition has no outputs: call fd.add_output")
            self._exe = Executable(self.graph, self.options, "fusion", self._scalars)
        return self._exe

    def execute(self, inputs: Sequence, compile_options=None) -> list[np.ndarray]:
        if compile_options is not None:
            self.options = parse_options(compile_options)
            self._exe = None
        return list(self.executable()(*inputs))

    @property
    def stats(self) -> dict:
        return self.executable().stats

    def print_ir(self, file=None) -> None:
        self.executable().print_ir(file)

    def print(self, file=None) -> None:
        """The definition as Python."""
        print(self.to_python(), file=file)

    def to_python(self) -> str:
        lines = ["def fusion(fd: FusionDefinition) -> None:"]
        lines += ["    " + ln for ln in self._lines]
        names = {n.id: f"T{n.attrs['index']}" if n.op == "input" and n.rank else f"S{n.attrs['index']}"
                 for n in self.graph.inputs}
        for n in self.graph.nodes():
            if n.op == "input":
                continue
            names[n.id] = f"T{n.id}" if n.rank else f"S{n.id}"
            lines.append(f"    {names[n.id]} = {_call(n, names)}")
        for o in self.graph.outputs:
            lines.append(f"    fd.add_output({names[o.id]})")
        return "\n".join(lines)

    __str__ = to_python


def _call(n: Node, names) -> str:
    a = [names[i.id] for i in n.inputs]
    at = n.attrs
    if n.op == "constant":
        return f"fd.define_constant({at['value']!r}, dtype={n.dtype!r})"
    if n.op == "tensor_constant":
        return f"fd.define_constant(np.zeros({tuple(n.shape)}))  # array constant"
    if n.op == "cast":
        return f"fd.ops.cast({a[0]}, dtype={n.dtype!r})"
    if n.op == "broadcast_in_dim":
        return f"fd.ops.broadcast_in_dim({a[0]}, shape={list(n.shape)}, broadcast_dims={list(at['dims'])})"
    if n.op == "reshape":
        return f"fd.ops.reshape({a[0]}, new_shape={list(n.shape)})"
    if n.op == "transpose":
        return f"fd.ops.permute({a[0]}, dims={list(at['perm'])})"
    if n.op == "slice":
        end = [s + (sh - 1) * st + 1 for s, sh, st in zip(at["start"], n.shape, at["strides"])]
        return f"fd.ops.slice({a[0]}, start_indices={list(at['start'])}, end_indices={end}, strides={list(at['strides'])})"
    if n.op == "pad":
        widths = [w for d in reversed(range(n.rank)) for w in (at["lo"][d], at["hi"][d])]
        return f"fd.ops.pad({a[0]}, {widths}, {at['value']!r})"
    if n.op == "concatenate":
        return f"fd.ops.cat([{', '.join(a)}], dim={at['axis']})"
    if n.op == "reverse":
        return f"fd.ops.reverse({a[0]}, {list(at['axes'])})"
    if n.op == "reduce":
        return f"fd.ops.{at['op']}({a[0]}, {list(at['axes'])}, {at['keepdim']})"
    if n.op == "dot_general":
        return f"fd.ops.dot_general({a[0]}, {a[1]}, ({list(at['lc'])}, {list(at['rc'])}), ({list(at['lb'])}, {list(at['rb'])}))"
    if n.op == "conv":
        return (f"fd.ops.conv({a[0]}, {a[1]}, {list(at['strides'])}, {[list(p) for p in at['padding']]}, "
                f"{list(at['dilation'])}, {at['groups']}, {at['layout']!r}, {at['kernel_layout']!r})")
    if n.op == "reduce_window":
        return (f"fd.ops.reduce_window({at['op']!r}, {a[0]}, {list(at['window'])}, {list(at['strides'])}, "
                f"{[list(p) for p in at['padding']]}, {list(at['dilation'])})")
    if n.op == "cumulative":
        return f"fd.ops.cumulative({at['op']!r}, {a[0]}, {at['axis']})"
    if n.op == "gather":
        if at["along"]:
            return f"fd.ops.take_along_axis({a[0]}, {a[1]}, {at['axis']})"
        return f"fd.ops.index_select({a[0]}, {at['axis']}, {a[1]})"
    if n.op == "scatter":
        return f"fd.ops.scatter_reduce({at['op']!r}, {list(n.shape)}, {a[0]}, {a[1]}, {at['axis']}, {at['along']})"
    if n.op == "iota":
        return f"fd.ops.iota({list(n.shape)}, {at['dim']}, {n.dtype!r})"
    if n.op == "rand_uniform":
        return f"fd.ops.rand_uniform({list(n.shape)}, {a[0]}, {at['offset']})"
    return f"fd.ops.{n.op}({', '.join(a)})"
