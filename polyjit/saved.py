"""Saved executables: an Executable's compiled programs in one file, run in
another process without tracing or compiling.

A file holds what the compile cache keeps of each program the executable
compiled (its plan as JSON and its objects: machine code, a GPU program's
PTX), the program's tensor constants as raw bytes, and the inputs' shapes
and dtypes; never pickles. A frontend's function (jit_jax's) adds how its
arguments reach the program: the arguments' and results' structure
(tuples, lists, dicts, None), which leaf is which input, and results that
are inputs or constants (a ``SavedFunction``). It is written in the
compile cache's form (cache.encode) behind a magic of its own and a
SHA-256, to a temporary file renamed into place. ``polyjit.load`` checks the magic, the checksum and the
polyjit that wrote it (its version and a digest of its sources, as the
compile cache does) at once, and a program's machine (the host's CPU
features for CPU code; a GPU's arch at its first call) when a call first
needs it. The checksum finds damage, not authorship: loading a file runs
its machine code, so load only files you trust.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Sequence

import numpy as np

from . import cache, interop
from .api import Executable
from .dtypes import DataType
from .errors import InputError, SavedExecutableError
from .graph import Graph
from .options import CompileOptions
from .runtime import CompiledProgram
from .targets import TARGETS

MAGIC = b"PJX1"
FORMAT = 1


def save(exe: Executable, path: str | os.PathLike, call: dict | None = None,
         constants: Sequence[np.ndarray] = ()) -> None:
    """Write exe's compiled programs (every target and input layout it has
    compiled for) to path; ``call`` (JSON) and ``constants`` (its arrays,
    by number): a frontend's function around exe (SavedFunction)."""
    programs = list(exe._variants.items())
    if not programs:
        raise InputError(f"{exe.name} has compiled nothing yet: call it once (or save it after polyjit.compile)")
    objects: list[bytes] = []
    entries = []
    for (layout, target), prog in programs:
        try:
            plan, code = TARGETS[target].entry(prog)
        except TypeError as e:  # a library step the cache's JSON cannot write (polyjit.library.CALLS)
            raise SavedExecutableError(f"{exe.name}: its {target} program cannot be saved: {e}") from None
        held = [np.asarray(c) for c in prog.constants]  # (tobytes: C order, any strides)
        entries.append({"layout": list(layout), "target": target,
                        "machine": TARGETS[target].machine_key(TARGETS[target].machine(exe.options.on(target))),
                        "plan": plan, "objects": len(code),
                        "constants": [[c.dtype.str, list(c.shape)] for c in held]})
        objects += code + [c.tobytes() for c in held]
    from .options import usable_cores
    head = {"format": FORMAT, "polyjit": cache.source_version(), "name": exe.name, "single_output": exe._single,
            "scalar_inputs": sorted(exe._scalars), "target": exe.options.target,
            # (threads the user asked for; a default follows the loading host's cores)
            "num_threads": exe.options.num_threads if exe.options.num_threads != usable_cores() else None,
            "inputs": [{"shape": [cache.size_json(s) for s in n.shape], "dtype": n.dtype.value,
                        "name": n.attrs["name"], "strided": bool(n.attrs.get("declared_strided", False))}
                       for n in exe.graph.inputs],
            "programs": entries}
    if call is not None:
        constants = [np.asarray(c) for c in constants]
        head["call"] = {**call, "constants": [[c.dtype.str, list(c.shape)] for c in constants]}
        objects += [c.tobytes() for c in constants]
    cache.write_atomically(Path(path), cache.encode(head, objects, MAGIC))


def load(path: str | os.PathLike) -> SavedExecutable | SavedFunction:
    """The executable saved at path, or the frontend's function around it
    (SavedExecutableError where the file is damaged, not one, or written by
    another polyjit). Loading runs the file's machine code: load only
    files you trust."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SavedExecutableError(f"cannot read the saved executable {str(path)!r}: {e}") from None
    try:
        head, objects = cache.decode(data, MAGIC)
        written_by = head["polyjit"]
    except cache.DAMAGED as e:
        raise SavedExecutableError(f"{str(path)!r} is not a polyjit saved executable, or it is damaged ({e})") \
            from None
    here = cache.source_version()
    if isinstance(head.get("format"), int) and head["format"] > FORMAT:
        raise SavedExecutableError(f"{str(path)!r} was saved by a newer polyjit ({written_by}, format "
                                   f"{head['format']}); this is {here} (format {FORMAT}): upgrade polyjit to load it")
    if head.get("format") != FORMAT or written_by != here:
        raise SavedExecutableError(f"{str(path)!r} was saved by {written_by} (format {head.get('format')}); this is "
                                   f"{here} (format {FORMAT}): save it again with this polyjit")
    try:
        exe = SavedExecutable(head, objects, str(path))
        if "call" not in head:
            return exe
        rest = objects[sum(p["objects"] + len(p["constants"]) for p in head["programs"]):]
        if len(rest) != len(head["call"]["constants"]):
            raise ValueError(f"{len(rest)} constants stored for {len(head['call']['constants'])}")
        return SavedFunction(exe, head["call"], [_array(dt, shape, b) for (dt, shape), b in
                                                 zip(head["call"]["constants"], rest)])
    except (KeyError, ValueError, TypeError, IndexError) as e:  # a checksum that holds over contents that do not
        raise SavedExecutableError(f"{str(path)!r} is not a well-formed polyjit saved executable "
                                   f"({type(e).__name__}: {e})") from None


def _array(dt: str, shape: list, data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.dtype(dt)).reshape(shape).copy()


class SavedExecutable(Executable):
    """An executable read from a file: its programs load as calls first
    need them, and nothing is traced or compiled. Called like the
    Executable that was saved, and also with torch tensors, JAX arrays or
    DLPack arrays, whose kind its results take (as FusionDefinition.execute)."""

    def __init__(self, head: dict, objects: list[bytes], path: str) -> None:
        g = Graph()
        for spec in head["inputs"]:
            n = g.input([cache.size_from(s) for s in spec["shape"]], DataType(spec["dtype"]), spec["name"],
                        spec["strided"])
            n.attrs["declared_strided"] = spec["strided"]
        options = CompileOptions(target=head["target"], **({"num_threads": head["num_threads"]}
                                                           if head.get("num_threads") else {}))
        super().__init__(g, options, head["name"], head["scalar_inputs"], head["single_output"])
        self.path = path
        self._saved: dict[tuple, tuple] = {}  # (layout, target) -> (entry, objects, constants)
        at = 0
        for entry in head["programs"]:
            code = objects[at:at + entry["objects"]]
            at += entry["objects"]
            constants = [_array(dt, shape, b) for (dt, shape), b in zip(entry["constants"], objects[at:])]
            at += len(constants)
            if len(code) != entry["objects"] or len(constants) != len(entry["constants"]):
                raise ValueError(f"program {entry['target']} {entry['layout']}: fewer objects than its entry lists")
            self._saved[tuple(entry["layout"]), entry["target"]] = (entry, code, constants)

    def variant(self, layout: tuple, target: str | None = None, example: Sequence | None = None) -> CompiledProgram:
        target = self._named(target)
        key = (tuple(layout), target)
        if key not in self._variants:
            if key not in self._saved:
                targets = {t for _, t in self._saved}
                hint = (f"pass arrays on the device it was saved for ({', '.join(sorted(targets))})"
                        if target not in targets else "pass contiguous arrays (.contiguous(), np.ascontiguousarray)")
                raise InputError(f"{self.name} (saved in {self.path!r}) has no program for this call: it needs "
                                 f"{_described(key)}, and the file holds {', '.join(map(_described, self._saved))}; "
                                 f"{hint}, or compile it for such inputs and save it again")
            self._variants[key] = self._load(key)
        return self._variants[key]

    def _load(self, key: tuple) -> CompiledProgram:
        entry, code, constants = self._saved[key]
        t = TARGETS[entry["target"]]
        start = time.perf_counter()
        why = t.foreign_code(entry["machine"])
        if why is not None:
            raise SavedExecutableError(f"{self.name} (saved in {self.path!r}) cannot run here: {why}; "
                                       "compile it on this machine instead")
        plan = entry["plan"]
        if not cache.define_derived(plan):
            raise SavedExecutableError(f"{self.name} (saved in {self.path!r}): its sizes' names mean other sizes "
                                       "in this process (a program compiled here named them first); load it in "
                                       "a fresh process")
        prog = t.load(constants, self.options.on(entry["target"]), self.name, plan, code)
        if prog is None:
            raise SavedExecutableError(f"{self.name} (saved in {self.path!r}): its {entry['target']} program calls "
                                       "a library (BLAS, cuBLAS or cuDNN) that does not load here")
        prog.stats.update(cache_hits=0, compile_seconds=time.perf_counter() - start)
        return prog

    def __call__(self, *args, **launch):
        if launch:
            return super().__call__(*args, **launch)
        call = interop.Call(args, self.name)
        outs = super().__call__(*call.arrays, **call.launch)
        results = call.results([outs] if self._single else list(outs))
        return results[0] if self._single else tuple(results)


def _described(key: tuple) -> str:
    layout, target = key
    strided = [k for k, s in enumerate(layout) if s]
    return f"{target} with " + (f"inputs {strided} strided" if strided else "contiguous inputs")


class SavedFunction:
    """A frontend's function read from a file (``jit_jax(f).save(path,
    *args)``): called with the arguments the function took, less the
    static ones, in the same structure; returns its results' structure,
    as arrays of the arguments' kind. ``call`` (the file's) says where
    each argument leaf goes (``inputs``: the leaf for each program input;
    ``bound``: the constants that are leaves after the arguments') and
    where each result leaf comes from (``outputs``: ["output", k],
    ["input", leaf] or ["constant", k])."""

    def __init__(self, exe: SavedExecutable, call: dict, constants: list[np.ndarray]) -> None:
        self.exe, self.call, self.constants = exe, call, constants
        self.__name__ = call.get("name", exe.name)

    @property
    def stats(self) -> dict:
        return self.exe.stats

    def __call__(self, *args, **kwargs):
        positional, named = self.call["args"]["tuple"]
        paths: list[str] = []
        leaves = flatten(positional, list(args), self.__name__, "arguments", paths) + \
            flatten(named, kwargs, self.__name__, "keyword arguments", paths) + \
            [self.constants[k] for k in self.call.get("bound", ())]  # (values saved with it: TF's variables)
        given = interop.Call(leaves, self.__name__)  # (the kind results take: the leaves')
        inputs = self.exe.graph.inputs
        where = [paths[k] if k < len(paths) else f"bound value {k}" for k in self.call["inputs"]]
        arrays = [self._argument(leaves[k], inputs[i], where[i]) for i, k in enumerate(self.call["inputs"])]
        _check_sizes(self.__name__, [a if a is not leaves[k] else given.arrays[k]  # (numpy arrays, GPU views)
                                     for a, k in zip(arrays, self.call["inputs"])], inputs, where,
                     self.call.get("bounds", {}))
        outs = self.exe(*arrays) if arrays else ()
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        made = given.results([outs[k] if kind == "output" else self.constants[k].copy()  # (not the saved array)
                              for kind, k in self.call["outputs"] if kind != "input"])
        made.reverse()  # (an input handed back is the caller's own)
        return unflatten(self.call["results"], [leaves[k] if kind == "input" else made.pop()
                                                for kind, k in self.call["outputs"]])

    def _argument(self, x, spec, path: str):
        """An argument leaf for input spec: a Python number as an array of
        the input's dtype, as the traced function took it, where that dtype
        holds it exactly (a float for an integer input, a bool for a number,
        a value out of range raise InputError naming the argument)."""
        if not isinstance(x, (bool, int, float)):
            return x
        dt = spec.dtype.numpy
        kind = "b" if isinstance(x, bool) else "i" if isinstance(x, int) else "f"
        fits = {"b": "b", "i": "iuf", "f": "f"}[kind]
        try:
            with np.errstate(all="ignore"):
                value = np.asarray(x, dt) if dt.kind in fits else None
        except OverflowError:
            value = None
        if value is None or (kind != "b" and np.isfinite(x) and value.item() != x and dt.kind != "f"):
            raise InputError(f"{self.__name__}: {path}: got the Python {type(x).__name__} {x!r}, expected "
                             f"{np.dtype(dt).name} (what it was saved with)")
        return value


def _check_sizes(name: str, arrays: list, inputs: list, paths: list[str], bounds: dict) -> None:
    """Each argument (a numpy array or a GPU view) against the program's
    input: its rank, dtype and sizes, symbolic sizes bound by the first
    argument they size alone and held to ``bounds`` (size -> [least,
    most or None]: torch.export's Dim ranges); InputError naming the
    argument, before any kernel runs."""
    env: dict[str, int] = {}
    for x, spec, path in zip(arrays, inputs, paths):
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)
        if len(shape) != len(spec.shape) or dtype != spec.dtype.numpy:
            raise InputError(f"{name}: {path}: got {dtype.name}{list(shape)}, expected "
                             f"{np.dtype(spec.dtype.numpy).name}[{', '.join(map(str, spec.shape))}]")
        for d, n in zip(spec.shape, shape):
            if isinstance(d, int):
                expected = d
            elif len(d.terms) == 1 and d.terms[0][1] == 1 and not d.const and d.base_params() == {d.terms[0][0]}:
                expected = env.setdefault(d.terms[0][0], n)
            else:
                continue
            low, high = bounds.get(d.terms[0][0], (None, None)) if not isinstance(d, int) else (None, None)
            if (low is not None and n < low) or (high is not None and n > high):
                raise InputError(f"{name}: {path}: got {dtype.name}{list(shape)}: its size {d} is {n}, saved for "
                                 f"{low} to {high if high is not None else 'any size'}")
            if n != expected:
                bound = "".join(f", {k}={v}" for k, v in env.items())
                raise InputError(f"{name}: {path}: got {dtype.name}{list(shape)}, expected "
                                 f"{np.dtype(spec.dtype.numpy).name}[{', '.join(map(str, spec.shape))}]{bound}")


# ------------------------------------------------------------ argument structure
def structure(tree, is_leaf, sort_keys: bool = True) -> object:
    """A nest of tuples, lists, dicts (string or int keys) and None whose
    leaves ``is_leaf`` tells, as JSON: what flatten checks arguments
    against and unflatten builds results of. Leaves are in the order the
    framework flattens them: dicts by sorted keys (JAX, TensorFlow), or as
    they were built (``sort_keys=False``: PyTorch)."""
    if is_leaf(tree):
        return "*"
    if tree is None:
        return None
    if type(tree) in (tuple, list):
        return {type(tree).__name__: [structure(t, is_leaf, sort_keys) for t in tree]}
    if type(tree) is dict and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in tree):
        keys = sorted(tree) if sort_keys else list(tree)
        return {"dict": [[k, structure(tree[k], is_leaf, sort_keys)] for k in keys]}
    if not sort_keys and isinstance(tree, Mapping) and all(isinstance(k, str) for k in tree):
        # a mapping of a class of its own (transformers' ModelOutput), flattened in its own order: a Record
        return {"record": [[k, structure(tree[k], is_leaf, sort_keys)] for k in tree]}
    raise SavedExecutableError(f"a {type(tree).__name__} among the arguments or results: a saved function takes "
                               "and returns arrays in tuples, lists, dicts and None (wrap a model whose results "
                               "are a class of its own in a function that returns its arrays)")


class Record(dict):
    """Results that were a mapping of a class of their own (transformers'
    ModelOutput): a dict of them, read by attribute too and, as a
    ModelOutput is, by position."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key):
        return tuple(self.values())[key] if isinstance(key, (int, slice)) else super().__getitem__(key)


def flatten(spec, tree, name: str, path: str, paths: list | None = None) -> list:
    """tree's leaves, where it has spec's structure (InputError naming
    where it differs: ``path`` is tree's name); each leaf's path appended
    to ``paths``."""
    if spec == "*":
        if paths is not None:
            paths.append(path)
        return [tree]
    if spec is None:
        if tree is not None:
            raise InputError(f"{name}: {path}: got a {type(tree).__name__}, expected None")
        return []
    (kind, items), = spec.items()
    if kind in ("dict", "record"):
        keys = [k for k, _ in items]
        if not isinstance(tree, Mapping) or sorted(tree, key=str) != sorted(keys, key=str):
            got = f"keys {sorted(tree, key=str)}" if isinstance(tree, Mapping) else f"a {type(tree).__name__}"
            raise InputError(f"{name}: {path}: got {got}, expected a dict of keys {keys}")
        return [x for k, sub in items for x in flatten(sub, tree[k], name, f"{path}[{k!r}]", paths)]
    if not isinstance(tree, (tuple, list)) or len(tree) != len(items):
        got = f"a {type(tree).__name__}" + (f" of {len(tree)}" if isinstance(tree, (tuple, list)) else "")
        raise InputError(f"{name}: {path}: got {got}, expected a {kind} of {len(items)}")
    return [x for k, (sub, t) in enumerate(zip(items, tree)) for x in flatten(sub, t, name, f"{path}[{k}]", paths)]


def unflatten(spec, leaves: Sequence):
    """The tree of spec's structure holding leaves, in order."""
    it = iter(leaves)

    def build(s):
        if s == "*":
            return next(it)
        if s is None:
            return None
        (kind, items), = s.items()
        if kind in ("dict", "record"):
            made = {k: build(sub) for k, sub in items}
            return made if kind == "dict" else Record(made)
        made = [build(sub) for sub in items]
        return tuple(made) if kind == "tuple" else made
    return build(spec)
