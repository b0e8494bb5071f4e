"""How the kernels are launched: programmatic dependent launch (PDL), off unless asked for.

A decode step is some two thousand short kernels one after another; with PDL (Hopper and later) a kernel may be
scheduled while the one before it finishes, its programs waiting in `wait_for_inputs` (`griddepcontrol.wait`) until
that one's writes are visible. So every kernel calls `wait_for_inputs` before it touches memory, and every launch
passes `launch_options()`. Off by default until timed on the GPU: `DEEPSEEK_V41_PDL=1` or `use_pdl(True)`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .common import INTERPRETED

_pdl = os.environ.get("DEEPSEEK_V41_PDL", "0") == "1"


def use_pdl(enabled: bool) -> None:
    """Launch the kernels with programmatic dependent launch from now on (or not). CUDA graphs record it."""
    global _pdl
    _pdl = bool(enabled)


def launch_options() -> dict:
    """The keyword arguments every kernel launch passes (the interpreter ignores them)."""
    return {"launch_pdl": _pdl}


@triton.jit
def wait_for_inputs():
    """Wait until the kernels launched before this one have finished and their writes are visible (a no-op when
    the launch was not programmatic, and in the interpreter, which runs launches one by one)."""
    if not INTERPRETED:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may be scheduled now; it waits as this one did
