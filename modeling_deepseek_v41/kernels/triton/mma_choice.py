"""Which decode-sized products run on the tensor cores through Gluon's mma_v2: the routed experts (moe_mma.py over
fp4_mma.py) and the linears (fp8_mma.py for FP8 weights, dense_mma.py for bf16/fp16 weights and fp32 ones with bf16
rows). The experts' switch is on wherever this Triton has Gluon (on the H100: batch-32 steps 8% faster, a 6-token
verify's experts 7% faster, batch 1 within 2%; benchmarks/results.md); the linears' is off (it loses at 1 and 32
rows).
`DEEPSEEK_V41_MMA_MOE=0|1` / `DEEPSEEK_V41_MMA_LINEARS=0|1` in the environment, or `use_mma_moe(...)` /
`use_mma_linears(...)`, choose otherwise. CUDA graphs record whichever is on when they are recorded."""

from __future__ import annotations

import importlib.util
import os

import triton


def gluon_available() -> bool:
    """Whether this Triton has Gluon with Ampere's mma_v2 (Triton 3.5 and later)."""
    try:
        return importlib.util.find_spec("triton.experimental.gluon.language.nvidia.ampere") is not None
    except ModuleNotFoundError:
        return False


def _checked(enabled: bool) -> bool:
    if enabled and not gluon_available():
        raise RuntimeError(f"the tensor-core decode needs Triton's Gluon (Triton >= 3.5; this is Triton "
                           f"{triton.__version__}); upgrade Triton or leave it off.")
    return bool(enabled)


def _from_environment(variable: str, default: bool) -> bool:
    """The switch `variable` sets ("0" or "1"), else `default`."""
    value = os.environ.get(variable)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{variable} takes 0 (off) or 1 (on), got {value!r}; set one of them or unset it")
    return _checked(value == "1")


_chosen = {"moe": _from_environment("DEEPSEEK_V41_MMA_MOE", gluon_available()),
           "linears": _from_environment("DEEPSEEK_V41_MMA_LINEARS", False)}


def use_mma_moe(enabled: bool) -> None:
    """Route packed-FP4 grouped MoE calls of decode size on CUDA through the tensor cores from now on (or not)."""
    _chosen["moe"] = _checked(enabled)


def use_mma_linears(enabled: bool) -> None:
    """Route decode-sized FP8 linears (and pairs) and fp32-weight linears of bf16 rows on CUDA through the tensor
    cores from now on (or not)."""
    _chosen["linears"] = _checked(enabled)


def block_rows(rows: float) -> int:
    """The rows a tensor-core program multiplies at once (the MMA's N: 8, 16 or 32) for a call of `rows` rows (a
    linear's, or the rows a chosen expert sees): fewer padded rows against fewer reads of the weights. Any choice
    gives a row the same sums. Offline sm_90, the FP8 linear: 260 / 372 / 603 SASS instructions per 128-column
    slice at 8 / 16 / 32 rows, 102 / 140 / 255 registers."""
    return 8 if rows <= 8 else 16 if rows <= 16 else 32


def mma_moe_enabled() -> bool:
    return _chosen["moe"]


def mma_linears_enabled() -> bool:
    return _chosen["linears"]
