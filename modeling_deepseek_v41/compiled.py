"""Accelerator fast paths: small pure functions compiled into fused kernels on first use (decode is
launch-bound on a GPU). Compilation is lazy, so importing the model never imports the compiler."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(function: Callable) -> Callable:
    """`function` compiled with dynamic shapes (once per function, on first use)."""
    return torch.compile(function, dynamic=True)
