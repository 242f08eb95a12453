"""NVIDIA's libraries (cuBLAS, cuDNN), found at run time with no framework
imported and bound with ctypes: where one may be (the path in an environment
variable, NVIDIA's wheels, the loader's path), the first that loads, kept
for the process (:class:`Found`), and what each binding shares
(:class:`VendorLibrary`: a handle per device, the scale factors 1 and 0)."""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys
import threading
from typing import Any, Callable

log = logging.getLogger("polyjit.library")


def candidates(lib: str, variable: str, versions: tuple[str, ...]) -> list[str]:
    """Where an NVIDIA library (lib: "cublas", "cudnn") may be: the path in
    the environment variable (a path; "none" for no library), NVIDIA's wheels
    in each site-packages folder, then the loader's path."""
    given = os.environ.get(variable)
    if given is not None:
        return [] if given.lower() in ("", "0", "none") else [given]
    found = []
    for base in dict.fromkeys(p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))):
        for pattern in (f"nvidia/*/lib*/lib{lib}.so*", f"nvidia/*/*/lib*/lib{lib}.so*"):
            found += sorted(glob.glob(os.path.join(base, pattern)), reverse=True)
    name = ctypes.util.find_library(lib)
    return found + ([name] if name else []) + [f"lib{lib}.so.{v}" for v in versions]


def first_loading(what: str, paths: list[str], bind: Callable[[str], Any]) -> Any:
    """bind(path) for the first of paths where it loads (OSError or
    AttributeError: it does not), or None."""
    found = None
    for path in paths:
        try:
            found = bind(path)
            break
        except (OSError, AttributeError) as e:
            log.debug("no %s at %s: %s", what, path, e)
    log.debug("%s: %s", what, found.path if found else "none")
    return found


class Found:
    """A library looked for at the first call: bind(path) of the first of
    candidates(lib, variable, versions) that loads, or None; kept until
    reset() (tests that move the variable)."""

    def __init__(self, what: str, lib: str, variable: str, versions: tuple[str, ...],
                 bind: Callable[[str], Any]) -> None:
        self.what, self.lib, self.variable, self.versions, self.bind = what, lib, variable, versions, bind
        self._found: Any = False
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        with self._lock:
            if self._found is False:
                self._found = first_loading(self.what, candidates(self.lib, self.variable, self.versions), self.bind)
            return self._found

    def reset(self) -> None:
        with self._lock:
            self._found = False


class VendorLibrary:
    """A library bound with ctypes: its path, the scale factors its calls
    take by address (alpha 1, beta 0) and a handle per device, made by
    init_handle."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.alpha, self.beta = ctypes.addressof(self.one), ctypes.addressof(self.zero)
        self.handles: dict[int, int] = {}
        self.lock = threading.Lock()

    def init_handle(self, h: ctypes.c_void_p) -> None:
        """Create the library's handle into h (in the current context)."""
        raise NotImplementedError

    def new_handle(self, dev) -> int:
        """A handle in dev's primary context; destroy(handle) frees it."""
        dev.activate()
        h = ctypes.c_void_p()
        self.init_handle(h)
        return h.value

    def handle(self, dev) -> int:
        """This device's shared handle (the Python launch path's), made at first use."""
        if dev.ordinal not in self.handles:
            self.handles[dev.ordinal] = self.new_handle(dev)
        return self.handles[dev.ordinal]
