"""The framework-free entry points: ``polyjit.compile`` and ``Executable``.

A program is traced once into a graph; an :class:`Executable` compiles it
for each layout of its inputs it meets (contiguous, or strided with runtime
strides) and checks every call's arguments before running anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import ops, printing
from . import sizes as sz
from .compiler import compile_graph
from .dtypes import DataType, to_dtype
from .errors import DefinitionError, InputError
from .graph import Graph
from .options import CompileOptions, parse_options
from .runtime import CompiledProgram
from .runtime.gpu_buffers import GpuView
from .sizes import Lin
from .targets import HOST, TARGETS, holding


def takes_device_arrays(target: str | None) -> bool:
    """Whether programs compiled with compile option ``target`` (None: for
    the device holding the arrays) may take arrays in device memory."""
    return target is None or TARGETS[target].device_arrays


@dataclass(frozen=True)
class InputInfo:
    """An input's shape and dtype. A dimension is an int (static), -1 or a
    (min, opt, max) tuple (symbolic: any size, one compiled program), or a
    name (dimensions with the same name are equal)."""

    shape: Sequence
    dtype: Any = DataType.Float


class Executable:
    """A compiled program; call it with numpy arrays or GPU arrays. With no
    target named, it is compiled (once each) for the device of each call's
    inputs."""

    def __init__(self, graph: Graph, options: CompileOptions, name: str, scalar_inputs=(),
                 single_output: bool = False) -> None:
        self.graph, self.options, self.name = graph, options, name
        self._variants: dict[tuple, CompiledProgram] = {}  # by (layout, target)
        self._scalars = set(scalar_inputs)
        self._single = single_output
        self.stats: dict = {}
        self.last: CompiledProgram | None = None
        self._dumped = False

    def _layout(self, args) -> tuple:
        return tuple(bool(inp.attrs.get("strided")) or _strided(a) for inp, a in zip(self.graph.inputs, args))

    def _prepare(self, args) -> list:
        n = len(self.graph.inputs)
        if len(args) != n:
            raise InputError(f"{self.name}: expected {n} inputs, got {len(args)}")
        out = []
        for k, (a, inp) in enumerate(zip(args, self.graph.inputs)):
            if k in self._scalars and isinstance(a, (bool, int, float, np.generic)):
                a = np.asarray(a, dtype=inp.dtype.numpy)
            if not isinstance(a, (np.ndarray, GpuView)) and not hasattr(a, "__cuda_array_interface__"):
                raise InputError(f"{self.name}: input {k} is a {type(a).__name__}, expected a numpy array "
                                 f"(or a GPU array) of dtype {inp.dtype} and rank {inp.rank}")
            out.append(a)
        return out

    def target(self, arrays: Sequence) -> str:
        """Where a call on these arrays runs: the named target, else the device
        holding them (any GPU array: nvgpu). Host arrays go to a GPU target
        and back; GPU arrays are refused by the CPU target."""
        on_gpu = [k for k, a in enumerate(arrays) if not isinstance(a, np.ndarray)]
        if self.options.target is None:
            return holding(bool(on_gpu))
        if on_gpu and not TARGETS[self.options.target].device_arrays:
            raise InputError(f"{self.name}: input {on_gpu[0]} is on a GPU, but compile option "
                             f"target={self.options.target!r} runs on the host; copy it to the host, or compile "
                             f"with target {holding(True)!r} or no target")
        return self.options.target

    def variant(self, layout: tuple, target: str | None = None, example: Sequence | None = None) -> CompiledProgram:
        """The program compiled for inputs of this layout (strided or not,
        per input) on ``target`` (default: the named one, else the CPU).
        ``example``: the arrays of the call that asks, whose shapes a
        ``POLYJIT_DUMP=python_definition`` reproducer records."""
        target = self._named(target)
        if (layout, target) not in self._variants:
            g = self.graph
            if not self._dumped and "python_definition" in printing.dump_kinds():
                self._dumped = True
                shapes = None if example is None else [_shape(a) for a in example]
                printing.dump(g, sorted(self._scalars), self.name, self.options.dump_dir, shapes)
            if any(layout):
                for inp, strided in zip(g.inputs, layout):
                    inp.attrs["strided"] = strided
            try:
                self._variants[layout, target] = compile_graph(g, self.options.on(target), self.name)
            finally:
                for inp in g.inputs:
                    inp.attrs["strided"] = inp.attrs.get("declared_strided", False)
        return self._variants[layout, target]

    def output_orders(self, target: str | None = None) -> dict[int, tuple[int, ...]]:
        """{output k: p} for the outputs ``target`` (default: the named one,
        else the host) would compute as ``transpose(value, p)``: a caller
        that may hand such an output out in any layout asks for it in that
        order before the first compile (a saved activation, channels last)."""
        target = self._named(target)
        return TARGETS[target].output_orders(self.graph, self.options.on(target))

    def _named(self, target: str | None) -> str:
        """target, else the compile options', else the host."""
        return target or self.options.target or HOST

    def __call__(self, *args, **launch):
        """Run on the arrays (numpy; on nvgpu also GPU arrays, with the
        ``stream=`` and ``empty=`` of :class:`polyjit.runtime.gpu_program.GpuProgram`)."""
        arrays = self._prepare(args)
        prog = self.variant(self._layout(arrays), self.target(arrays), arrays)
        outs = prog(*arrays, **launch)
        self.last = prog
        self.stats = prog.stats
        return outs[0] if self._single else tuple(outs)

    def save(self, path) -> None:
        """Write the programs compiled so far (each target and input layout
        called with) to ``path``; ``polyjit.load(path)`` runs them in any
        process on a machine like this one, without tracing or compiling."""
        from .saved import save
        save(self, path)

    def compile_default(self) -> CompiledProgram:
        return self.last or self.variant(tuple(bool(i.attrs.get("strided")) for i in self.graph.inputs))

    def print_ir(self, file=None) -> None:
        """The affine program, the isl schedule and the generated loop nest."""
        prog = self.compile_default()
        for stage in ("affine", "schedule", "ast"):
            print(f"// ---- {stage}", file=file)
            print(prog.ir[stage], file=file)

    def ir(self, stage: str) -> str:
        """One stage's text: graph, affine, schedule, ast, mapping (each
        kernel's plan), llvm or llvm_opt; on nvgpu also ptx."""
        return self.compile_default().ir[stage]


def _shape(a) -> tuple:
    if hasattr(a, "shape"):
        return tuple(a.shape)
    return tuple(a.__cuda_array_interface__["shape"])


def _strided(a) -> bool:
    """Whether an argument is laid out other than row-major (numpy or GPU
    array). A numpy vector is copied where it is not (the copy costs what a
    strided read does); a GPU program reads its inputs in place, so a
    strided vector (``x[::2]``) is strided too."""
    if isinstance(a, np.ndarray):
        return not a.flags.c_contiguous and a.ndim > 1
    if isinstance(a, GpuView):
        shape, strides = a.shape, a.strides
    else:
        cai = getattr(a, "__cuda_array_interface__", None) or {}
        shape, strides = cai.get("shape", ()), cai.get("strides")
        if strides is not None:
            strides = tuple(x // np.dtype(cai["typestr"]).itemsize for x in strides)
    return strides is not None and len(shape) > 0 and tuple(strides) != sz.row_major(shape)


def _input_shape(info: InputInfo, k: int, names: dict) -> tuple:
    shape = []
    for d, s in enumerate(info.shape):
        if isinstance(s, bool):
            raise DefinitionError(f"input {k} dimension {d}: {s!r} is not a size")
        if isinstance(s, int) and s >= 0:
            shape.append(s)
        elif s == -1 or isinstance(s, (tuple, list)):
            shape.append(Lin.param(f"n{k}_{d}"))
        elif isinstance(s, str):
            names.setdefault(s, Lin.param(s if s.isidentifier() else f"n{k}_{d}"))
            shape.append(names[s])
        else:
            raise DefinitionError(f"input {k} dimension {d}: {s!r} is not an int, -1, a (min, opt, max) tuple or a name")
    return tuple(shape)


def compile(fn: Callable, args: Sequence[InputInfo], compile_options: Mapping | None = None) -> Executable:
    """Trace fn (a function or callable object written against polyjit.ops
    and Tensor operators) and compile it. Arrays fn closes over (numpy, or a
    framework's, through __dlpack__ or __array__) become constants of the
    program; computations on them alone run once, while tracing."""
    options = parse_options(compile_options)
    g = Graph()
    names: dict = {}
    tensors = []
    for k, info in enumerate(args):
        if not isinstance(info, InputInfo):
            raise DefinitionError(f"args[{k}] is a {type(info).__name__}, expected polyjit.InputInfo")
        tensors.append(ops.Tensor(g, g.input(_input_shape(info, k, names), to_dtype(info.dtype))))
    result = fn(*tensors)
    name = getattr(fn, "__name__", type(fn).__name__)
    single = not isinstance(result, (tuple, list))
    for r in ([result] if single else result):
        if not isinstance(r, ops.Tensor):
            raise DefinitionError(f"{name} returned a {type(r).__name__}, expected Tensors")
        g.add_output(r.node)
    exe = Executable(g, options, name if name.isidentifier() else "fn", single_output=single)
    # compiled now (with no target named, for the host), so that its errors come from compile()
    exe.stats = exe.variant(tuple(False for _ in g.inputs)).stats
    return exe
