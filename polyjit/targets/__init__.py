"""Targets: each one (cpu, nvgpu) owns what it does to a program that the
others do not: its graph passes, scheduling rewrites, emitter, how its code
is built and loaded, and the executable that runs it (targets.base)."""
from __future__ import annotations

from .base import Target
from .cpu import CpuTarget
from .nvgpu import NvgpuTarget

TARGETS: dict[str, Target] = {"cpu": CpuTarget(), "nvgpu": NvgpuTarget()}
HOST = "cpu"  # where a program runs with no target named and no array on a device


def target(name: str | None) -> Target:
    """The target named (None: the host's)."""
    return TARGETS[name or HOST]


def holding(on_device: bool) -> str:
    """The target for arrays in device memory (on_device) or on the host."""
    return next(n for n, t in TARGETS.items() if t.device_arrays) if on_device else HOST


__all__ = ["TARGETS", "HOST", "Target", "CpuTarget", "NvgpuTarget", "target", "holding"]
