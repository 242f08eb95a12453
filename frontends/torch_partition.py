"""Inductor's min-cut partition of a training step, remembered in polyjit's
compile cache.

With the compile cache warm, min-cut is most of what a training step's
compile costs beyond AOTAutograd's tracing, in two steps: its CSE pass
(whose first call imports Inductor's pattern matcher) and its choice of
the values the forward saves (networkx's max-flow). Both are decisions
about the joint graph's nodes, kept as their names (JSON, in a cache
entry keyed by the joint graph with its values' shapes, strides, dtypes
and aliasing, the partition's arguments, functorch's config and the
versions of torch and polyjit). A process that finds them runs min-cut
with those two steps replaying the decisions: every other step is torch's
own, so the forward and backward are the graphs min-cut gives.

The two steps are private names of ``torch._functorch.partitioners``;
where they are missing, or replaying fails, min-cut runs whole (logged at
debug level).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import partitioners as _partitioners
from torch._functorch.partitioners import min_cut_rematerialization_partition

from polyjit import cache

log = logging.getLogger("polyjit.torch")
FORMAT = 1
_STEPS = ("fx_graph_cse", "choose_saved_values_set")
_META = ("recompute", "ac_graph_id", "partitioner_tag", "memory_budget", "custom", "has_backward_hook",
         "saved_tensor_with_no_vc_check", "saved_for_quantization", "autograd_backward")  # what min-cut reads
_REGION = "mutation_region_id"  # the meta Inductor's CSE sets on every node of the joint graph

counts: collections.Counter = collections.Counter()  # "solved", "replayed": partitions made, partitions replayed
_lock = threading.RLock()
_local = threading.local()


def partition(joint: fx.GraphModule, joint_inputs, *, use_cache: bool = True, **kwargs) -> tuple:
    """``min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)``,
    its decisions read from the compile cache where an entry has them and
    written there where none has."""
    if not use_cache or getattr(_local, "session", None) is not None:
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    try:
        key = partition_key(joint, kwargs)
        if not all(callable(getattr(_partitioners, name, None)) for name in _STEPS):
            raise AttributeError(f"torch._functorch.partitioners lacks one of {_STEPS}")
        entry = cache.load(key)
        session = _Session(_decision(entry[0]) if entry else None)
    except Exception as e:  # (torch without these steps; a graph the key cannot print)
        log.debug("min-cut's partition is not cached: %r", e)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    try:
        with _replaced(session):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    except Exception as e:
        if not session.replayed:
            raise  # min-cut's own failure, as without the cache
        log.debug("replaying min-cut's cached decisions failed (%r); partitioning again", e)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    counts["replayed" if session.replayed else "solved"] += 1
    if session.storable():
        try:
            cache.store(key, {"partition": FORMAT, **session.record}, [])
        except Exception as e:
            log.debug("min-cut's partition was not written to the cache: %r", e)
    return fw, bw


def partition_key(joint: fx.GraphModule, kwargs: dict) -> str:
    """A hash of all that min-cut's decisions depend on: the joint graph's
    nodes (op, target, arguments, the meta min-cut reads), their values'
    shapes (symbolic sizes with their hints), strides, dtypes, devices and
    which share storage; the partition's arguments, functorch's config,
    torch's and polyjit's versions."""
    lines = [f"polyjit partition {FORMAT}", f"torch {torch.__version__}", _stable(sorted(kwargs.items())),
             _config_text()]
    _graph_lines(joint, {}, lines)
    return cache.digest(*lines)


def _graph_lines(gm: fx.GraphModule, storages: dict, lines: list) -> None:
    """gm's nodes, one line each, with the graphs of the submodules they name
    (a higher-order op's body)."""
    for n in gm.graph.nodes:
        meta = [f"{k}={_stable(n.meta[k])}" for k in _META if k in n.meta]
        lines.append(f"{n.name} {n.op} {_target(n.target)} {_stable(n.args)} {_stable(n.kwargs)} "
                     f"{_value(n.meta.get('val'), storages)} {meta}")
        if n.op == "get_attr":
            attr = gm
            for part in n.target.split("."):
                attr = getattr(attr, part)
            if isinstance(attr, fx.GraphModule):
                lines.append(f"{{ {n.target}")
                _graph_lines(attr, storages, lines)
                lines.append("}")
            else:
                lines.append(f"= {_value(attr, storages)}")


class _Session:
    """One partition's decisions: those read from the cache (``decision``)
    and those made now (``record``)."""

    def __init__(self, decision: dict | None) -> None:
        self.decision = decision or {}
        self.record: dict = {}
        self.replayed: set = set()
        self.calls: collections.Counter = collections.Counter()
        self.valid = True

    def storable(self) -> bool:
        return self.valid and not self.replayed and "saved" in self.record

    def fx_graph_cse(self, original, graph: fx.Graph, *args, **kwargs) -> fx.Graph:
        self.calls["cse"] += 1
        if self.calls["cse"] > 1:
            self.valid = False
            return original(graph, *args, **kwargs)
        if "cse" in self.decision:
            try:
                new = _replay_cse(graph, self.decision["cse"], self.decision.get("regions"))
                self.replayed.add("cse")
                return new
            except Exception as e:
                log.debug("the cached CSE does not fit the joint graph (%r); running it", e)
        new = original(graph, *args, **kwargs)
        try:
            self.record["cse"], self.record["regions"] = _cse_decision(graph, new)
        except Exception as e:
            log.debug("the CSE's replacements were not found (%r); not caching", e)
            self.valid = False
        return new

    def choose_saved_values_set(self, original, joint_graph: fx.Graph, *args, **kwargs):
        self.calls["saved"] += 1
        if self.calls["saved"] == 1 and "saved" in self.decision:
            nodes = {n.name: n for n in joint_graph.nodes}
            if all(name in nodes for name in self.decision["saved"]):
                self.replayed.add("saved")
                return [nodes[name] for name in self.decision["saved"]]
            log.debug("the cached saved values are not in the joint graph; choosing them")
        saved = original(joint_graph, *args, **kwargs)
        if self.calls["saved"] == 1 and isinstance(saved, list) and all(isinstance(n, fx.Node) for n in saved):
            self.record["saved"] = [n.name for n in saved]
        else:
            self.valid = False
        return saved


@contextlib.contextmanager
def _replaced(session: _Session):
    """min-cut's steps replaced, for this thread's session; another thread's
    min-cut meanwhile runs torch's own."""
    with _lock:
        steps = {name: getattr(_partitioners, name) for name in _STEPS}
        for name, original in steps.items():
            setattr(_partitioners, name, _step(name, original))
        _local.session = session
        try:
            yield
        finally:
            _local.session = None
            for name, original in steps.items():
                setattr(_partitioners, name, original)


def _step(name: str, original):
    def step(*args, **kwargs):
        session = getattr(_local, "session", None)
        if session is None:
            return original(*args, **kwargs)
        return getattr(session, name)(original, *args, **kwargs)
    return step


def _decision(entry: dict) -> dict | None:
    """A cache entry's decisions, checked for shape (a wrong one is a miss)."""
    if entry.get("partition") != FORMAT:
        return None
    out = {}
    pairs, regions, saved = entry.get("cse"), entry.get("regions"), entry.get("saved")
    if isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p)
                                       for p in pairs):
        out["cse"] = pairs
        if isinstance(regions, dict) and all(isinstance(v, int) for v in regions.values()):
            out["regions"] = regions
    if isinstance(saved, list) and all(isinstance(s, str) for s in saved):
        out["saved"] = saved
    return out


def _cse_decision(old: fx.Graph, new: fx.Graph) -> tuple[list, dict | None]:
    """What Inductor's CSE did to old, making new: each removed node's name
    with the name of the node that stands for it, in graph order; and the
    mutation regions it noted (non-zero ones, by name). A node's stand-in is
    read off a user's arguments in new, position by position."""
    kept = {n.name: n for n in new.nodes}
    nodes = list(old.nodes)
    image: dict[fx.Node, fx.Node] = {}
    for n in reversed(nodes):  # users first
        if n.name in kept:
            m = kept[n.name]
            if (m.op, m.target) != (n.op, n.target):
                raise ValueError(f"{n.name} changed in the CSE")
            image[n] = m
            continue
        for user in n.users:
            if user in image:
                for a, b in zip(_arg_nodes(user), _arg_nodes(image[user])):
                    if a is n:
                        image[n] = b
                        break
            if n in image:
                break
        else:
            raise ValueError(f"no stand-in for {n.name}")
    if len(kept) != sum(n.name in kept for n in nodes):
        raise ValueError("the CSE renamed nodes")
    pairs = [[n.name, image[n].name] for n in nodes if n.name not in kept]
    regions = ({n.name: n.meta[_REGION] for n in nodes if n.meta[_REGION]}
               if all(isinstance(n.meta.get(_REGION), int) for n in nodes) else None)
    return pairs, regions


def _replay_cse(graph: fx.Graph, pairs: list, regions: dict | None) -> fx.Graph:
    """The graph Inductor's CSE makes of graph, built from its decision as
    that pass builds it: a new graph of the kept nodes' copies."""
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    gone: dict[fx.Node, fx.Node] = {}
    for name, by in pairs:
        n, m = nodes[name], nodes[by]
        if n.op != "call_function" or (m.op, m.target) != (n.op, n.target) or order[m] >= order[n]:
            raise ValueError(f"{name} cannot stand for {by}")
        gone[n] = m
    if any(m in gone for m in gone.values()):
        raise ValueError("a removed node stands for another")
    if regions is not None:
        for n in graph.nodes:
            n.meta[_REGION] = regions.get(n.name, 0)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        env[n] = env[gone[n]] if n in gone else new.node_copy(n, env.__getitem__)
    return new


def _arg_nodes(n: fx.Node) -> list:
    out: list = []
    fx.node.map_arg((n.args, n.kwargs), out.append)
    return out


@functools.cache
def _config_text() -> str:
    from torch._functorch import config
    return _stable(sorted(config.get_config_copy().items()))


def _stable(v: Any) -> str:
    """repr, with functions by their qualified names (their reprs hold addresses)."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_stable(x) for x in v) + ("]" if isinstance(v, list) else ",)")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_stable(k)}: {_stable(x)}" for k, x in v.items()) + "}"
    text = repr(v)
    if " at 0x" in text:
        return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', type(v).__qualname__)}"
    return text


def _target(t) -> str:
    if isinstance(t, str) or isinstance(t, torch._ops.OpOverload):
        return str(t)
    return _stable(t)


def _value(v, storages: dict) -> str:
    """A node's value as min-cut sees it: a tensor's sizes (with their hints),
    strides, dtype, device and storage (numbered in order of first use)."""
    if isinstance(v, torch.Tensor):
        try:
            from torch.multiprocessing.reductions import StorageWeakRef
            storage = storages.setdefault(StorageWeakRef(v.untyped_storage()), len(storages))
        except Exception:
            storage = "?"
        return (f"T{[_size(d) for d in v.shape]}{[_size(d) for d in v.stride()]}+{_size(v.storage_offset())}"
                f"{v.dtype}{v.device}#{storage}{'g' if v.requires_grad else ''}")
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_value(x, storages) for x in v) + ")"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"S{_size(v)}"
    return "-" if v is None else f"{type(v).__name__}:{_stable(v)}"


def _size(d) -> str:
    if isinstance(d, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{d}~{getattr(d.node, 'hint', None)}"
    return str(d)
