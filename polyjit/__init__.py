"""polyjit: a polyhedral JIT compiler for tensor programs.

The core (this package) imports no framework; frontends live in
``polyjit.frontends`` and are loaded on first use of ``jit_torch``,
``jit_jax`` or ``jit_tf``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import errors, ops
from .api import Executable, InputInfo, compile
from .dtypes import DataType
from .fusion_definition import FusionDefinition
from .options import CompileOptions

if TYPE_CHECKING:
    from .saved import SavedFunction

__version__ = "0.1.0"
__all__ = ["FusionDefinition", "DataType", "compile", "InputInfo", "Executable", "ops", "errors",
           "CompileOptions", "jit_torch", "jit_jax", "jit_tf", "cuda_synchronize", "load"]


def load(path: str | os.PathLike) -> Executable | SavedFunction:
    """What ``Executable.save`` (or a jit function's ``save``) wrote to
    ``path``: an Executable, or a function of the saved one's arguments,
    whose programs load without tracing or compiling."""
    from .saved import load as _load
    return _load(path)


def cuda_synchronize() -> None:
    """Wait until all work polyjit queued on GPUs has finished."""
    from .runtime.cuda import synchronize
    synchronize()


def __getattr__(name: str):
    import importlib
    if name in ("jit_torch", "jit_jax", "jit_tf"):
        mod = importlib.import_module(f"polyjit.frontends.{name[4:]}")
        return getattr(mod, name)
    if name == "frontends":  # its framework modules load when first named
        return importlib.import_module("polyjit.frontends")
    raise AttributeError(f"module 'polyjit' has no attribute {name!r}")
