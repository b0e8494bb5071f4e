"""How the kernels are launched: programmatic dependent launch (PDL), off unless asked for.

A decode step is some fifteen hundred short kernels one after another; with PDL (Hopper and later, Triton with
`launch_pdl`) a kernel may be scheduled while the one before it finishes, its programs waiting in
`wait_for_inputs` (`griddepcontrol.wait`) until that one's writes are visible. So every kernel calls
`wait_for_inputs` before it touches memory, and every launch passes `launch_options()`. Off by default until timed
on the GPU: `DEEPSEEK_V41_PDL=1` or `use_pdl(True)`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .common import INTERPRETED

# Triton versions before grid dependency control compile the kernels without the wait (they cannot launch with PDL)
HAS_GDC = tl.constexpr(hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"))


def _supported() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return bool(HAS_GDC) and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def use_pdl(enabled: bool) -> None:
    """Launch the kernels with programmatic dependent launch from now on (or not). CUDA graphs record it."""
    global _pdl
    if enabled and not _supported():
        raise RuntimeError(f"Programmatic dependent launch needs a Triton with launch_pdl and grid dependency "
                           f"control (this is Triton {triton.__version__}); upgrade Triton or leave it off.")
    _pdl = bool(enabled)


_pdl = False
if os.environ.get("DEEPSEEK_V41_PDL", "0") == "1":
    use_pdl(True)


def launch_options() -> dict:
    """The keyword arguments every kernel launch passes (none unless PDL is on; the interpreter ignores them)."""
    return {"launch_pdl": True} if _pdl else {}


@triton.jit
def wait_for_inputs():
    """Wait until the kernels launched before this one have finished and their writes are visible (a no-op when
    the launch was not programmatic, and in the interpreter, which runs launches one by one)."""
    if HAS_GDC:
        if not INTERPRETED:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may be scheduled now; it waits as this one did
