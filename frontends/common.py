"""What every frontend shares: compile stats and the fallback rule (counted,
warned once per op, refused under ``strict``). Imports no framework."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from polyjit.errors import UnsupportedOpError

_warned: set = set()


@dataclass
class Stats:
    """What polyjit did for one decorated function: summed over its graphs."""

    graphs: dict = field(default_factory=dict)
    fallbacks: int = 0
    fallback_ops: set = field(default_factory=set)

    def record(self, name: str, stats: dict) -> None:
        self.graphs[name] = dict(stats)

    def as_dict(self) -> dict:
        out = {"graphs": len(self.graphs), "fallbacks": self.fallbacks,
               "fallback_ops": sorted(self.fallback_ops)}
        for key in ("kernels", "statements", "fused", "inlined", "contracted_buffers", "intermediate_bytes"):
            out[key] = sum(s.get(key, 0) for s in self.graphs.values())
        return out


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
