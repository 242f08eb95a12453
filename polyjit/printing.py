"""A graph as text: the FusionDefinition Python that rebuilds it, and its canonical form.

``python_definition`` prints a graph (from a FusionDefinition or from any
frontend) as a script that rebuilds an equal graph through FusionDefinition:
``fd.print()`` and ``POLYJIT_DUMP=python_definition`` (a reproducer of a
compiled graph, without the model that made it). ``canonical`` is the graph's
structure with nothing that depends on how it was built (node ids, size
parameter names, input names): definitions with equal canonical forms compute
the same, and share one id and one compiled program.
"""
from __future__ import annotations

import base64
import collections
import hashlib
import logging
import os
import re
from typing import Callable, Sequence

import numpy as np

from . import sizes as sz
from .errors import DefinitionError
from .graph import Graph, Node
from .sizes import Lin

log = logging.getLogger("polyjit.dump")
LITERAL_ELEMENTS = 64  # array constants up to this size print as np.array literals, larger as base64
DUMP_KINDS = ("python_definition",)


# ------------------------------------------------------------------ sizes
def _input_sizes(g: Graph, name: Callable[[int, int], str], declared: bool = False) -> tuple[dict, list[list]]:
    """Each size parameter the inputs' shapes name, as an expression of the
    dimension that first has it (``name(input, dim)``); and each input's
    dimensions as printed: an int, -1 (a size of its own), a name in quotes
    (a size several dimensions share) or an expression of earlier inputs'
    sizes. ``declared``: the sizes as the inputs were defined, before ops
    made some of them equal (a definition run again makes them equal again);
    else as they are now."""
    shapes = [[s if declared else g.resolve(s) for s in inp.shape] for inp in g.inputs]
    plain = [[_plain(s) for s in row] for row in shapes]
    uses = collections.Counter(p for row in plain for p in row if p is not None)
    refs: dict[str, str] = {}
    named: dict[str, str] = {}
    dims: list[list] = []
    for k, row_in in enumerate(shapes):
        earlier = dict(refs)  # the sizes of earlier inputs: this one's are not defined while it is
        row = []
        for d, s in enumerate(row_in):
            p = plain[k][d]
            if not isinstance(s, Lin):
                row.append(int(s))
            elif p is not None:
                refs.setdefault(p, name(k, d))
                row.append(repr(named.setdefault(p, f"s{len(named)}")) if uses[p] > 1 else -1)
            elif s.base_params() <= set(earlier):
                row.append(size_text(s, earlier))
            else:
                raise DefinitionError(f"input {k} dimension {d} has size {s}, which names sizes that no "
                                      "earlier input has; it cannot be printed")
            root = _plain(g.resolve(s))
            if root is not None:
                refs.setdefault(root, name(k, d))
        dims.append(row)
    return refs, dims


def _plain(s) -> str | None:
    """The parameter a size is, if it is one (not a sum, a multiple or a quotient)."""
    if isinstance(s, Lin) and len(s.terms) == 1 and s.const == 0 and s.terms[0][1] == 1 \
            and s.terms[0][0] not in sz._DERIVED:
        return s.terms[0][0]
    return None


def size_text(s, refs: dict[str, str]) -> str:
    """A size as an expression of the names in refs (a derived parameter as
    the floor division it stands for)."""
    if not isinstance(s, Lin):
        return str(int(s))
    parts = []
    for p, c in s.terms:
        if p in sz._DERIVED:
            num, k = sz._DERIVED[p]
            ref = f"(({size_text(num, refs)}) // {k})"
        elif p in refs:
            ref = refs[p]
        else:
            raise DefinitionError(f"the size {s} names {p}, which no input's shape has")
        parts.append(ref if c == 1 else f"{ref} * {c}")
    if s.const:
        parts.append(str(s.const))
    return " + ".join(parts).replace("+ -", "- ")


def _shape(g: Graph, shape, refs) -> str:
    return "[" + ", ".join(size_text(g.resolve(s), refs) for s in shape) + "]"


# -------------------------------------------------------------- canonical
def canonical(g: Graph, scalars: Sequence[int] = ()) -> str:
    """The graph's structure as text: inputs (shape, dtype, layout, scalar or
    not), each node reachable from the outputs by position, the size
    equalities left to check, the outputs."""
    refs, dims = _input_sizes(g, lambda k, d: f"T{k}_{d}")
    lines = []
    for k, (inp, row) in enumerate(zip(g.inputs, dims)):
        strided = inp.attrs.get("declared_strided", inp.attrs.get("strided", False))
        kind = "scalar" if k in set(scalars) else "tensor"
        lines.append(f"%{k} = {kind} {inp.dtype}[{', '.join(map(str, row))}] strided={bool(strided)}")
    pos = {inp.id: k for k, inp in enumerate(g.inputs)}
    for n in g.nodes():
        if n.is_input:
            continue
        pos[n.id] = len(pos)
        args = ", ".join(f"%{pos[i.id]}" for i in n.inputs)
        attrs = ", ".join(f"{k}={_attr(v, g, refs)}" for k, v in sorted(n.attrs.items()))
        lines.append(f"%{pos[n.id]} = {n.op}({args}; {attrs}) : {n.dtype}{_shape(g, n.shape, refs)}")
    cons = set()
    for a, b in g.constraints:
        a, b = size_text(g.resolve(a), refs), size_text(g.resolve(b), refs)
        if a != b:
            cons.add(" == ".join(sorted((a, b))))
    lines += [f"assert {c}" for c in sorted(cons)]
    lines.append("return " + ", ".join(f"%{pos[o.id]}" for o in g.outputs))
    return "\n".join(lines)


def _attr(v, g: Graph, refs) -> str:
    if isinstance(v, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:20]
        return f"array({v.dtype.str}, {list(v.shape)}, {digest})"
    if isinstance(v, Lin):
        return size_text(g.resolve(v), refs)
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_attr(x, g, refs) for x in v) + ")"
    return repr(v.item() if isinstance(v, np.generic) else v)


# ----------------------------------------------------------------- python
def python_definition(g: Graph, scalars: Sequence[int] = (), name: str = "fusion") -> str:
    """A script that rebuilds the graph: ``def name(fd)`` with one line per
    input and node, then ``with FusionDefinition() as fd: name(fd)``."""
    scalars = set(scalars)
    names: dict[int, str] = {}
    refs, dims = _input_sizes(g, lambda k, d: f"T{k}.shape[{d}]", declared=True)
    body = []
    for k, (inp, row) in enumerate(zip(g.inputs, dims)):
        if k in scalars:
            names[inp.id] = f"S{k}"
            body.append(f"S{k} = fd.define_scalar(dtype={inp.dtype!r})")
            continue
        names[inp.id] = f"T{k}"
        strided = inp.attrs.get("declared_strided", inp.attrs.get("strided", False))
        contiguity = [None if s == 1 else not strided for s in row]
        shape = "[" + ", ".join(map(str, row)) + "]"
        body.append(f"T{k} = fd.define_tensor(shape={shape}, contiguity={contiguity}, dtype={inp.dtype!r})")
    for n in g.nodes():
        if n.is_input:
            continue
        names[n.id] = f"{'T' if n.rank else 'S'}{len(names)}"
        body.append(f"{names[n.id]} = {_call(n, g, names, refs)}")
    body += [f"fd.add_output({names[o.id]})" for o in g.outputs]
    head = ["import base64", "", "import numpy as np", "from polyjit import DataType, FusionDefinition", "", ""]
    return "\n".join(head + [f"def {name}(fd: FusionDefinition) -> None:"] + ["    " + b for b in body]
                     + ["", "", "with FusionDefinition() as fd:", f"    {name}(fd)", ""])


def _num(v) -> str:
    """A Python scalar as source (inf and nan are not literals)."""
    if isinstance(v, float) and not np.isfinite(v):
        return f"float({str(v)!r})"
    return repr(v)


def _array(a: np.ndarray) -> str:
    dt = f"np.dtype({a.dtype.str!r})"
    if a.size <= LITERAL_ELEMENTS and (a.dtype.kind not in "fc" or np.isfinite(a).all()):
        return f"np.array({a.tolist()!r}, dtype={dt})"
    data = base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()
    return f"np.frombuffer(base64.b64decode({data!r}), dtype={dt}).reshape({list(a.shape)}).copy()"


def _lit(v, g: Graph, refs: dict) -> str:
    """An attribute as source: lists, numbers, strings and sizes."""
    if isinstance(v, Lin):
        return size_text(g.resolve(v), refs)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_lit(x, g, refs) for x in v) + "]"
    if isinstance(v, np.generic):
        v = v.item()
    return _num(v) if isinstance(v, float) else repr(v)


_CALLS = {  # op -> the FusionDefinition call that rebuilds it, from operands a and the attributes
    "broadcast_in_dim": "fd.ops.broadcast_in_dim({a0}, shape={shape}, broadcast_dims={dims})",
    "reshape": "fd.ops.reshape({a0}, new_shape={shape})",
    "transpose": "fd.ops.permute({a0}, dims={perm})",
    "concatenate": "fd.ops.cat([{args}], dim={axis})",
    "reverse": "fd.ops.reverse({a0}, {axes})",
    "dot_general": "fd.ops.dot_general({a0}, {a1}, ({lc}, {rc}), ({lb}, {rb}))",
    "reduce_window": "fd.ops.reduce_window({op}, {a0}, {window}, {strides}, {padding}, {dilation})",
    "cumulative": "fd.ops.cumulative({op}, {a0}, {axis})",
    "iota": "fd.ops.iota({shape}, {dim}, {dtype}, like=fd)",
    "rand_uniform": "fd.ops.rand_uniform({shape}, {a0}, {offset})",
    "philox_bits": "fd.ops.philox_bits({a0}, {a1}, {shape})",
    "cast": "fd.ops.cast({a0}, {dtype})",
    "bitcast": "fd.ops.bitcast({a0}, {dtype})",
    "tensor_constant": "fd.define_constant({array})",
    "size": "fd.define_scalar({size})",
}


def _slice_call(n: Node, g: Graph, a: list, f: dict, refs: dict) -> str:
    end = [s + (sh - 1) * st + 1 if not sz.is_static(sh) or sh > 0 else s
           for s, sh, st in zip(n.attrs["start"], map(g.resolve, n.shape), n.attrs["strides"])]
    return f"fd.ops.slice({a[0]}, start_indices={f['start']}, end_indices={_lit(end, g, refs)}, strides={f['strides']})"


def _pad_call(n: Node, g: Graph, a: list, f: dict, refs: dict) -> str:
    widths = [w for d in reversed(range(n.rank)) for w in (n.attrs["lo"][d], n.attrs["hi"][d])]
    return f"fd.ops.pad({a[0]}, {_lit(widths, g, refs)}, {f['value']})"


def _gather_call(n: Node, g: Graph, a: list, f: dict, refs: dict) -> str:
    if n.attrs["along"]:
        return f"fd.ops.take_along_axis({a[0]}, {a[1]}, {n.attrs['axis']})"
    return f"fd.ops.index_select({a[0]}, {n.attrs['axis']}, {a[1]})"


_BUILT = {  # op -> the function that writes the call rebuilding it, where a format string cannot
    "constant": lambda n, g, a, f, refs: (f"fd.{'define_scalar' if n.attrs.get('weak') else 'define_constant'}"
                                          f"({f['value']}, dtype={f['dtype']})"),
    "slice": _slice_call,
    "pad": _pad_call,
    "reduce": lambda n, g, a, f, refs: f"fd.ops.{n.attrs['op']}({a[0]}, {f['axes']}, {f['keepdim']})",
    "gather": _gather_call,
    "scatter": lambda n, g, a, f, refs: (f"fd.ops.scatter_reduce({f['op']}, {f['shape']}, {a[0]}, {a[1]}, "
                                         f"{f['axis']}, {f['along']}{', base=' + a[2] if len(a) > 2 else ''})"),
    "random_bits": lambda n, g, a, f, refs: (f"fd.ops.random_bits({a[0]}, {f['shape']}"
                                             + "".join(f", {k}={f[k]}" for k in ("word", "offset") if k in f) + ")"),
    "conv": lambda n, g, a, f, refs: (f"fd.ops.conv({a[0]}, {a[1]}, {f['strides']}, {f['padding']}, {f['dilation']}, "
                                      f"{f['groups']}, {f['layout']}, {f['kernel_layout']}"
                                      f"{', input_dilation=' + f['input_dilation'] if 'input_dilation' in f else ''})"),
}


def _call(n: Node, g: Graph, names: dict, refs: dict) -> str:
    a = [names[i.id] for i in n.inputs]
    at = n.attrs
    f = {k: _lit(v, g, refs) for k, v in at.items() if not isinstance(v, np.ndarray)}
    f.update({f"a{k}": x for k, x in enumerate(a)}, args=", ".join(a), dtype=repr(n.dtype),
             shape=_lit(n.shape, g, refs))
    if n.op in _CALLS:
        array = _array(at["value"]) if isinstance(at.get("value"), np.ndarray) else ""
        return _CALLS[n.op].format(array=array, **f)
    if n.op in _BUILT:
        return _BUILT[n.op](n, g, a, f, refs)
    if set(at) - {"materialize", "packed"}:
        raise DefinitionError(f"{n.op} with attributes {sorted(at)} has no printed form")
    return f"fd.ops.{n.op}({', '.join(a)})"


# ------------------------------------------------------------------- dump
def dump_kinds() -> set[str]:
    """What POLYJIT_DUMP (a comma-separated list) asks for."""
    asked = {k.strip() for k in os.environ.get("POLYJIT_DUMP", "").split(",") if k.strip()}
    for k in asked - set(DUMP_KINDS):
        log.warning("POLYJIT_DUMP names %r, which is not one of %s", k, list(DUMP_KINDS))
    return asked


def reproducer(g: Graph, scalars: Sequence[int], name: str, shapes: Sequence | None) -> str:
    """A standalone script: the definition, then (run as a program) a call on
    random inputs of the shapes it was compiled for, or on the arrays of an
    .npz file named on the command line."""
    fn = name if name.isidentifier() else "fusion"
    text = python_definition(g, scalars, fn)
    shapes = list(shapes) if shapes is not None else [None] * len(g.inputs)
    makers = []
    for k, (inp, shp) in enumerate(zip(g.inputs, shapes)):
        if shp is None:  # not known here: 4 for each symbolic size
            shp = tuple(int(s) if sz.is_static(s) else 4 for s in inp.shape)
        makers.append(f"            _random({tuple(int(s) for s in shp)}, {str(inp.dtype)!r}),")
    return "\n".join([
        f"# polyjit: the graph {name!r} as compiled (POLYJIT_DUMP=python_definition).",
        "# Run it: python this_file.py [inputs.npz]  (random inputs of the shapes it was compiled for)",
        "import sys", text, "",
        "_rng = np.random.default_rng(0)", "", "",
        "def _random(shape, dtype):",
        "    rng = _rng",
        "    if dtype == 'bool':",
        "        return rng.random(shape) < 0.5",
        "    if np.dtype(dtype).kind in 'iu':",
        "        return rng.integers(0, 2, shape).astype(dtype)",
        "    return rng.standard_normal(shape).astype(dtype)",
        "", "",
        "if __name__ == '__main__':",
        "    if len(sys.argv) > 1:",
        "        data = np.load(sys.argv[1])",
        "        inputs = [data[k] for k in data.files]",
        "    else:",
        "        inputs = [", *makers, "        ]",
        "    for k, out in enumerate(fd.execute(inputs)):",
        "        out = np.asarray(out)",
        "        print(f'output {k}: {out.dtype}{list(out.shape)} sum {float(out.astype(np.float64).sum())!r}')",
        ""])


def dump(g: Graph, scalars: Sequence[int], name: str, folder: str, shapes: Sequence | None) -> str | None:
    """Write the reproducer to folder/<name>_<hash>.py (one file per distinct
    graph) and say where on the "polyjit.dump" logger; a graph that cannot be
    printed is reported there too, never an error of the compilation."""
    try:
        text = reproducer(g, scalars, name, shapes)
        digest = hashlib.sha1(canonical(g, scalars).encode()).hexdigest()[:12]
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{re.sub(r'[^A-Za-z0-9_]', '_', name)}_{digest}.py")
        with open(path, "w") as f:
            f.write(text)
    except (DefinitionError, OSError) as e:
        log.warning("polyjit: %s: could not write its definition as Python: %s", name, e)
        return None
    log.warning("polyjit: %s: its definition as Python is in %s", name, path)
    return path
