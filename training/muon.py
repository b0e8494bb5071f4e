"""Head-wise Muon: momentum, then Newton–Schulz orthogonalisation of each row block (attention head) separately."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

# first stage: the quintic of torch.optim.Muon (Keller Jordan's coefficients), which pushes every singular value into
# roughly [0.7, 1.2] quickly; second stage: a quintic whose fixed point 1 has zero slope, so the spread collapses to 1
FAST_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
FINISH_COEFFICIENTS = (2.0, -1.5, 0.5)
FAST_STEPS = 8
FINISH_STEPS = 2
_NEGLIGIBLE = 1e-15  # entries of a unit-Frobenius matrix below this are far under fp32 resolution

_TorchMuon = getattr(torch.optim, "Muon", None)


def orthogonalize(blocks: torch.Tensor, fast_steps: int = FAST_STEPS, finish_steps: int = FINISH_STEPS,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of each matrix in `blocks` [..., m, n] (G = U S V^T) by Newton–Schulz, in fp32.

    Zero blocks stay zero. Singular values of the result are 1 within about 1e-2 for well-conditioned inputs;
    directions whose singular value is below ~1e-4 of the block's Frobenius norm are damped rather than lifted.
    """
    x = blocks.float()
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    for step in range(fast_steps + finish_steps):
        a, b, c = FAST_COEFFICIENTS if step < fast_steps else FINISH_COEFFICIENTS
        # low-rank gradients (an expert that saw a few tokens) make the quintic term of their null directions
        # underflow into subnormals, which are ~100x slower on CPUs; they are far below anything that matters here
        gram = x @ x.mT
        gram = gram.masked_fill(gram.abs() < _NEGLIGIBLE, 0)
        x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.masked_fill(x.abs() < _NEGLIGIBLE, 0)
    return x.mT if transposed else x


def row_blocks(update: torch.Tensor, block_rows: int | None) -> torch.Tensor:
    """View a [out, in] update as [out // block_rows, block_rows, in] (one block per head); None: one block."""
    if block_rows is None:
        return update.unsqueeze(0)
    if update.shape[0] % block_rows:
        raise ValueError(f"{update.shape[0]} rows do not split into blocks of {block_rows}.")
    return update.view(update.shape[0] // block_rows, block_rows, update.shape[1])


@torch.no_grad()
def muon_step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], *, lr: float, weight_decay: float,
              momentum: float, nesterov: bool, update_rms: float, block_rows: int | None) -> None:
    """One (head-wise) Muon update of a 2-D `param` in place.

    M = momentum * M + (1 - momentum) * g; the Nesterov direction g + momentum * (M - g) is split into row blocks,
    each block orthogonalised on its own and scaled by `update_rms * sqrt(max(block shape))` so that every block's
    update has RMS `update_rms` (0.18 lets AdamW learning rates carry over); decoupled weight decay.
    """
    if grad.is_sparse:
        raise RuntimeError("Muon needs dense gradients; sparse-gradient tables belong to the Sinkhorn rule.")
    if param.dim() != 2:
        raise ValueError(f"Muon updates 2-D weights, got shape {tuple(param.shape)}.")
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(param, dtype=torch.float32)
    buf = state["momentum_buffer"]
    g = grad.float()
    buf.lerp_(g, 1 - momentum)
    direction = g.lerp(buf, momentum) if nesterov else buf
    blocks = row_blocks(direction, block_rows)
    ortho = orthogonalize(blocks) * (update_rms * math.sqrt(max(blocks.shape[-2:])))
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.add_(ortho.reshape(param.shape).to(param.dtype), alpha=-lr)


def closure_loss(closure) -> Any:
    """What an optimizer step's `closure` returns, evaluated with gradients on (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class HeadwiseMuon(_TorchMuon or Optimizer):  # type: ignore[misc]
    """torch.optim.Muon with per-head orthogonalisation and an AdamW-matched update RMS.

    Each param group may carry `block_rows`: the weight's rows are cut into blocks of that many rows (one attention
    head each) and every block gets its own orthogonalised update; None treats the weight as one block. Uses torch's
    Muon for argument checking and state layout where the installed torch has it.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 update_rms: float = 0.18, block_rows: int | None = None) -> None:
        if _TorchMuon is not None:
            super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
        else:
            Optimizer.__init__(self, params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                                  nesterov=nesterov))
        for group in self.param_groups:
            group.setdefault("update_rms", update_rms)
            group.setdefault("block_rows", block_rows)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch's signature
        """One update of every parameter that has a gradient."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    muon_step(p, p.grad, self.state[p], lr=group["lr"], weight_decay=group["weight_decay"],
                              momentum=group["momentum"], nesterov=group["nesterov"],
                              update_rms=group["update_rms"], block_rows=group["block_rows"])
        return loss
