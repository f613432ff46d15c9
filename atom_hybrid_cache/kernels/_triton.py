"""Optional Triton: every kernel module imports it from here, so a machine
without Triton still gets the torch paths.

`triton_usable(t)` says whether a Triton kernel can run on tensor `t`: on a
GPU tensor, or on a CPU tensor when TRITON_INTERPRET=1 was set as this
package was imported (kernels then run in the Triton interpreter: slow,
tests only).
"""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False


if HAS_TRITON:
    @triton.jit
    def cast_for_store(x, dst_ptr):
        """x cast to what dst_ptr points to, rounding to nearest even.

        The GPU's fp32 -> bf16 conversion rounds to nearest even, as torch's
        does, but the Triton interpreter truncates; rounding by hand here makes
        a bf16 checkpoint bit-identical to torch's cast on both."""
        if dst_ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dst_ptr.dtype.element_ty)
else:  # pragma: no cover
    cast_for_store = None

# Triton functions that are called from kernels, never launched themselves
# (the kernel-hygiene test checks every other one).
DEVICE_FUNCTIONS = ("cast_for_store",)


# Triton decides at decoration time whether a kernel is compiled or runs in
# the interpreter, so what counts is the setting when these modules loaded.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when this package's kernels were built for the Triton interpreter
    (which also needs TRITON_INTERPRET still set while they run)."""
    return HAS_TRITON and _INTERPRETED and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(t) -> bool:
    if not HAS_TRITON:
        return False
    return bool(t.is_cuda) or (t.device.type == "cpu" and interpreting())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def resolve_backend(backend: str, t) -> str:
    """'auto' -> 'triton' where a kernel can run on `t`, else 'torch'."""
    if backend == "auto":
        return "triton" if triton_usable(t) else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not triton_usable(t):
        raise RuntimeError("backend='triton' needs Triton and a GPU tensor "
                           "(or TRITON_INTERPRET=1 for CPU tensors)")
    return backend
