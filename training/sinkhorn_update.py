"""Sinkhorn-balanced update for vocabulary-row matrices (token embedding, output head, Engram tables).

One momentum buffer; the Nesterov direction has its negligible rows dropped, then rows and columns are
L2-normalised in turn (ending on rows), so that the update's row RMS and column RMS are both about 1.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from modeling_deepseek_v41.layers.engram import DeepseekV41EngramTable


def sinkhorn_balance(direction: torch.Tensor, iterations: int = 11, tau: float = 1e-3,
                     eps: float = 1e-20) -> torch.Tensor:
    """sqrt(n) * U for a [m, n] direction, where U is `direction` after `iterations` alternating row / column L2
    normalisations (odd iterations rows, even columns) with rows of norm <= tau * mean row norm zeroed.

    Works with one row and one column scaling vector over the squared entries instead of rewriting the matrix
    every iteration, which is the same arithmetic as normalising in place.
    """
    if iterations % 2 == 0:
        raise ValueError(f"iterations must be odd so that the last normalisation is over rows, got {iterations}.")
    x = direction.float()
    squares = x.square()
    row_norms = squares.sum(dim=1).sqrt()
    rows = (row_norms > tau * row_norms.mean()).float()
    cols = torch.ones(x.shape[1], dtype=torch.float32, device=x.device)
    for k in range(iterations):
        if k % 2 == 0:
            rows = rows / (rows * (squares @ cols.square()).sqrt() + eps)
        else:
            cols = cols / (cols * (rows.square() @ squares).sqrt() + eps)
    return math.sqrt(x.shape[1]) * rows.unsqueeze(1) * x * cols.unsqueeze(0)


@torch.no_grad()
def sinkhorn_step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], *, lr: float, beta: float,
                  nesterov: bool, gamma: float, iterations: int, tau: float, eps: float) -> None:
    """One Sinkhorn-balanced update of a 2-D `param` in place: W -= gamma * lr * balance(Nesterov momentum).

    A sparse (COO) gradient touches only its rows: their momentum rows are advanced and balanced as one matrix and
    only those parameter rows move, so a table far larger than the batch's rows is never densified. Rows absent
    from a step keep their momentum untouched until they are next looked up (lazy, like SparseAdam); with every
    row present this equals the dense update.
    """
    if param.dim() != 2:
        raise ValueError(f"The Sinkhorn-balanced update needs a 2-D weight, got shape {tuple(param.shape)}.")
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(param, dtype=torch.float32)
    buf = state["momentum_buffer"]
    if grad.is_sparse:
        grad = grad.coalesce()
        index, values = grad.indices()[0], grad.values().float()
        momentum = buf.index_select(0, index).lerp_(values, 1 - beta)
        buf.index_copy_(0, index, momentum)
        direction = values.lerp(momentum, beta) if nesterov else momentum
        update = sinkhorn_balance(direction, iterations, tau, eps)
        param.index_add_(0, index, update.to(param.dtype), alpha=-gamma * lr)
        return
    g = grad.float()
    buf.lerp_(g, 1 - beta)
    direction = g.lerp(buf, beta) if nesterov else buf
    param.add_(sinkhorn_balance(direction, iterations, tau, eps).to(param.dtype), alpha=-gamma * lr)


def _sparse_lookup(self: nn.Module, row_ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(row_ids, self.weight, sparse=True)


def enable_sparse_table_gradients(model: nn.Module) -> int:
    """Make the Engram tables of a bf16-mode model produce sparse (touched rows only) gradients; returns how many
    tables were switched. The lookup result is unchanged (`F.embedding` reads the same rows as `weight[row_ids]`).

    Sparse gradients cannot go through `torch.nn.utils.clip_grad_norm_`: train with `max_grad_norm=0` (the
    Sinkhorn and Muon updates do not depend on the gradient's scale).
    """
    switched = 0
    for module in model.modules():
        if isinstance(module, DeepseekV41EngramTable) and not module.quantized:
            module.forward = types.MethodType(_sparse_lookup, module)
            switched += 1
    return switched
