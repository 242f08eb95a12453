"""The on-disk compile cache: a compiled program's object code (a GPU
program's PTX, as text) and plan.

An entry is keyed by the graph (printed canonically: node ids renumbered,
attribute values by repr), the program's name, the options that change
code, the target (the host's triple, CPU and features; a GPU's sm_XX and
multiprocessor count) and the versions of polyjit (with a
digest of its sources), llvmlite and islpy. It holds the plan as JSON
(arrays, integer slots, kernels, stats, IR texts; a GPU program's library
steps as their statements, statement_json) and the object files, never
pickles, behind a SHA-256 of its contents: a truncated or corrupted
entry is found, removed, warned about and compiled again. Writes go to a
temporary file renamed into place, so readers see whole entries and two
processes writing one key both succeed. Past ``POLYJIT_CACHE_BYTES``
(1 GiB by default) the least recently used entries go.

The torch frontend keeps its training steps' partitions (min-cut's
decisions, as node names) in entries of their own: frontends/torch_partition.py.

``POLYJIT_CACHE_DIR`` picks the folder (default ``$XDG_CACHE_HOME/polyjit``
or ``~/.cache/polyjit``); ``compile_options={"cache": False}`` skips it.

Within a process, :class:`ProcessCache` keeps what compiling made
(scheduled groups, kernels' code, GPU programs) by key.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import struct
import tempfile
import threading
import warnings
import weakref
import zlib
from pathlib import Path

import numpy as np

from . import expr as E
from .affine import Array, Role, Statement
from .dtypes import DataType
from .graph import Graph
from .library import CALLS
from . import sizes as sz
from .sizes import Lin

log = logging.getLogger("polyjit.cache")
MAGIC = b"PJC1"
FORMAT = 3  # 2: a segment's unread inputs leave its graph; 3: every input in the key
DEFAULT_BYTES = 1 << 30
DAMAGED = (ValueError, KeyError, TypeError, struct.error, zlib.error, UnicodeDecodeError)  # what decode raises


class ProcessCache:
    """Values by key, at most size of them (the oldest goes first), shared
    by the process's threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: dict = {}
        self._lock = threading.Lock()
        _process_caches.add(self)

    def get(self, key):
        """The value kept for key, or None."""
        with self._lock:
            return self._items.get(key)

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.pop(next(iter(self._items)))


def _unlock_after_fork() -> None:
    """A forked child has only the forking thread: no lock is held there."""
    for c in list(_process_caches):
        c._lock = threading.Lock()


_process_caches: "weakref.WeakSet[ProcessCache]" = weakref.WeakSet()
os.register_at_fork(after_in_child=_unlock_after_fork)


def cache_dir() -> Path:
    """POLYJIT_CACHE_DIR, else the user's cache folder."""
    given = os.environ.get("POLYJIT_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "polyjit"


@functools.cache
def source_version() -> str:
    """polyjit's version and a digest of its sources: code changes without a
    version change must not load stale code (the cache's, a saved file's)."""
    from . import __version__
    digest = hashlib.sha256()
    for root in _source_roots():
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root.parent).as_posix().encode() + b"\0" + path.read_bytes())
    return f"polyjit {__version__} {digest.hexdigest()[:16]}"


@functools.cache
def _versions() -> str:
    """source_version, llvmlite's, islpy's and numpy's versions."""
    import islpy
    import llvmlite
    return (f"{source_version()} llvmlite {llvmlite.__version__} islpy {islpy.__version__}"
            f" numpy {np.__version__}")  # its OpenBLAS timed the library choices


def _source_roots() -> list[Path]:
    """The folders of polyjit's sources: the core's and the frontends' (a
    folder of its own), whose decisions the cache keeps too (torch.compile's
    partitions, the marks of traces compiled)."""
    found = importlib.util.find_spec("polyjit.frontends")
    frontends = [Path(p) for p in (found.submodule_search_locations or [])] if found else []
    return [Path(__file__).parent, *frontends]


def graph_text(graph: Graph) -> str:
    """The graph with node ids numbered in order and every attribute by repr."""
    ids: dict[int, int] = {}
    lines = []
    for n in graph.nodes():
        ids[n.id] = len(ids)
        attrs = {k: ("array", v.shape, str(v.dtype)) if isinstance(v, np.ndarray) else v for k, v in n.attrs.items()}
        lines.append(f"{n.op}({[ids[i.id] for i in n.inputs]}, {sorted(attrs.items(), key=str)!r}, "
                     f"{n.shape!r}, {n.dtype})")
    # every input, read or not: the program takes them all as arguments
    lines.append(f"inputs {[(ids.get(i.id), i.shape, str(i.dtype)) for i in graph.inputs]!r}")
    lines.append(f"return {[ids[o.id] for o in graph.outputs]} constraints {graph.constraints!r}")
    return "\n".join(lines)


def digest(*parts: str) -> str:
    """A key for an entry that depends on parts and on this cache format,
    polyjit's sources and the libraries' versions (_versions)."""
    return hashlib.sha256("\n".join([f"format {FORMAT}", _versions(), *parts]).encode()).hexdigest()


def key(graph: Graph, name: str, options_key: tuple, target: str) -> str:
    return digest(target, repr(options_key), name, graph_text(graph))


def load(key: str) -> tuple[dict, list[bytes]] | None:
    """The plan and objects stored under key; None if there are none or the
    entry is damaged (then it is removed, with a warning)."""
    path = cache_dir() / f"{key}.pjc"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        entry = decode(data)
    except DAMAGED as e:
        warnings.warn(f"polyjit: the compile cache entry {path} is damaged ({e}); removed, compiling again",
                      RuntimeWarning, stacklevel=3)
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)  # recently used: evicted last
    except OSError:
        pass
    return entry


def store(key: str, plan: dict, objects: list[bytes]) -> None:
    """Write an entry atomically; a failure to write only loses the entry."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / f"{key}.pjc", encode(plan, objects))
        _evict(folder, int(os.environ.get("POLYJIT_CACHE_BYTES", DEFAULT_BYTES)))
    except OSError as e:
        log.warning("polyjit: could not write the compile cache in %s: %s", folder, e)


def write_atomically(path: Path, data: bytes) -> None:
    """data written to a temporary file beside path, then renamed onto it:
    a reader sees the old file or the whole new one. Its mode is a new
    file's under the process's umask (mkstemp's is 0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def encode(plan: dict, objects: list[bytes], magic: bytes = MAGIC) -> bytes:
    """plan as compressed JSON, then the objects, behind magic and a SHA-256
    of the rest (a cache entry's form; a saved executable's, with its own magic)."""
    head = zlib.compress(json.dumps({**plan, "objects": [len(o) for o in objects]}).encode(), 1)
    payload = struct.pack("<Q", len(head)) + head + b"".join(objects)
    return magic + hashlib.sha256(payload).digest() + payload


def decode(data: bytes, magic: bytes = MAGIC) -> tuple[dict, list[bytes]]:
    """encode's plan and objects; ValueError (and the like) where data is
    not of that form, or damaged."""
    if data[:4] != magic:
        raise ValueError("not a polyjit cache entry" if magic == MAGIC else "not a polyjit file of this kind")
    payload = data[36:]
    if hashlib.sha256(payload).digest() != data[4:36]:
        raise ValueError("checksum mismatch")
    (n,) = struct.unpack_from("<Q", payload)
    plan = json.loads(zlib.decompress(payload[8:8 + n]))
    objects, at = [], 8 + n
    for size in plan.pop("objects"):
        objects.append(payload[at:at + size])
        at += size
    if at != len(payload):
        raise ValueError("length mismatch")
    return plan, objects


def _evict(folder: Path, limit: int) -> None:
    """Remove the least recently used entries while the folder holds more than limit bytes."""
    entries = []
    for p in folder.glob("*.pjc"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        p.unlink(missing_ok=True)
        total -= size


# ---------------------------------------------------------------- JSON
def size_json(s):
    return {"terms": [list(t) for t in s.terms], "const": s.const} if isinstance(s, Lin) else int(s)


def size_from(j):
    return Lin(tuple((n, c) for n, c in j["terms"]), j["const"]) if isinstance(j, dict) else j


def define_derived(plan: dict) -> bool:
    """Define the derived size parameters (products, quotients) a cached
    program's plan names, as the process that compiled it had them; False
    where one of the names stands for something else here (a miss)."""
    return all(sz.define(n, kind, size_from(a), size_from(b)) for n, (kind, a, b) in plan.get("derived", {}).items())


def array_json(a: Array) -> dict:
    return {"name": a.name, "shape": [size_json(s) for s in a.shape], "dtype": a.dtype.value, "kind": a.kind,
            "strided": a.strided, "index": a.index,
            "returned_as": None if a.returned_as is None else [size_json(s) for s in a.returned_as]}


def array_from(j: dict) -> Array:
    view = j.get("returned_as")
    return Array(j["name"], tuple(size_from(s) for s in j["shape"]), DataType(j["dtype"]), j["kind"],
                 j["strided"], j["index"], None if view is None else tuple(size_from(s) for s in view))


def expr_json(e: E.Expr) -> list:
    """An expression as nested lists: [kind, dtype, ...]; its constants as
    JSON numbers (read back as the same ints, floats or bools)."""
    if isinstance(e, E.Const):
        v = e.value.item() if isinstance(e.value, np.generic) else e.value
        if not isinstance(v, (bool, int, float)):
            raise TypeError(f"a constant {v!r} of type {type(v).__name__} in an expression")
        return ["c", e.dtype.value, v]
    if isinstance(e, E.Var):
        return ["v", e.dtype.value, e.name, e.kind]
    if isinstance(e, E.Load):
        return ["l", e.dtype.value, e.array, [expr_json(i) for i in e.index]]
    if isinstance(e, E.Op):
        return ["o", e.dtype.value, e.op, [expr_json(a) for a in e.args]]
    raise TypeError(f"not an expression: {e!r}")


def expr_from(j: list) -> E.Expr:
    kind, dt = j[0], DataType(j[1])
    if kind == "c":
        return E.Const(dt, j[2])
    if kind == "v":
        return E.Var(dt, j[2], j[3])
    if kind == "l":
        return E.Load(dt, j[2], tuple(expr_from(i) for i in j[3]))
    if kind == "o":
        return E.Op(dt, j[2], tuple(expr_from(a) for a in j[3]))
    raise ValueError(f"not an expression: {j!r}")


# the classes a library statement is made of, by name: only these are read back (never code from an entry)
_CLASSES = {c.__name__: c for c in (Statement, Role, *CALLS)}


def statement_json(s: Statement):
    """A statement (a library step: its iterators, bounds, call with its
    boxes and sizes) as JSON, field by field: expressions, sizes, tuples,
    the call's class and the statement's role tagged, so that statement_from
    gives back an equal statement."""
    return _value_json(s)


def statement_from(j) -> Statement:
    return _value_from(j)


def _value_json(v):
    if isinstance(v, E.Expr):
        return {"expr": expr_json(v)}
    if isinstance(v, Lin):
        return {"size": size_json(v)}
    if isinstance(v, tuple):
        return {"tuple": [_value_json(x) for x in v]}
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    cls = _CLASSES.get(type(v).__name__)
    if cls is not type(v):
        raise TypeError(f"the compile cache cannot write a {type(v).__name__} (not in polyjit.library.CALLS)")
    if isinstance(v, Role):
        return {"enum": cls.__name__, "value": v.value}
    return {"class": cls.__name__, "fields": {f.name: _value_json(getattr(v, f.name))
                                              for f in dataclasses.fields(v)}}


def _value_from(j):
    if not isinstance(j, dict):
        return j
    if "expr" in j:
        return expr_from(j["expr"])
    if "size" in j:
        return size_from(j["size"])
    if "tuple" in j:
        return tuple(_value_from(x) for x in j["tuple"])
    if "enum" in j:
        return _CLASSES[j["enum"]](j["value"])
    return _CLASSES[j["class"]](**{k: _value_from(v) for k, v in j["fields"].items()})
