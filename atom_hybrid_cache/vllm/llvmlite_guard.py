"""LMCache imports numba, and with it llvmlite, whose library handle
(`llvmlite.binding.ffi.lib`) forwards every attribute, `__dict__` too, to
a C function wrapper. vLLM 0.32's CPU build (no Triton) scans every
module's namespace at each worker start for kernels to override, reads
`vars(value)` of each object, and fails on that handle: every vLLM CPU
engine started in a process that has imported LMCache stops with
"'_lib_fn_wrapper' object has no attribute 'get'" (a second in-process
engine, or a script that imports LMCache first; a GPU build never scans).

`make_llvmlite_scan_safe` makes the handle answer dunder lookups as a
plain object does (AttributeError): no C function is named `__...`, so
llvmlite's own calls are unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys


def make_llvmlite_scan_safe(load: bool = False) -> bool:
    """Patch llvmlite's library handle where llvmlite is loaded; True when
    it is (now or before). `load`: where LMCache is installed, load
    llvmlite's binding first (~40 ms), so that an LMCache imported later in
    this process (after the plugin registered, before the next engine
    starts) finds it patched."""
    if (load and "llvmlite.binding.ffi" not in sys.modules
            and importlib.util.find_spec("lmcache") is not None
            and importlib.util.find_spec("llvmlite") is not None):
        importlib.import_module("llvmlite.binding.ffi")
    ffi = sys.modules.get("llvmlite.binding.ffi")
    handle = getattr(ffi, "lib", None)
    if handle is None:
        return False
    cls = type(handle)
    if getattr(cls, "_atom_scan_safe", False):
        return True
    forward = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return forward(self, name)

    cls.__getattr__ = __getattr__
    cls._atom_scan_safe = True
    return True
