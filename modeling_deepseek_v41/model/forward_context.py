"""What one forward over the backbone shares and produces: the `ForwardContext` the layers of one forward share
(computed once before the first layer) and the `BackboneRun` a pass over the layers records."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.attention import ForwardShare


@dataclass
class ForwardContext:
    """Everything the layers of one forward share, computed once before the first layer."""

    positions: torch.Tensor  # [B,S], -1 for padding
    rotations: dict[tuple[float, bool], tuple[torch.Tensor, torch.Tensor]]  # (theta, yarn) -> (angles, inv_freq)
    engram_rows: torch.Tensor | None  # [B,S,n_engram_layers,columns]
    engram_live: torch.Tensor | None  # [B,S] False at image-span and padding positions
    image_mask: torch.Tensor | None  # [B,S] True inside image spans
    share: ForwardShare

    def tail(self, count: int) -> "ForwardContext":
        """The same forward restricted to its last `count` tokens (sharing the CSA2 share)."""
        return ForwardContext(
            positions=self.positions[:, -count:],
            rotations={k: (angles[:, -count:], inv) for k, (angles, inv) in self.rotations.items()},
            engram_rows=None if self.engram_rows is None else self.engram_rows[:, -count:],
            engram_live=None if self.engram_live is None else self.engram_live[:, -count:],
            image_mask=None if self.image_mask is None else self.image_mask[:, -count:],
            share=self.share,
        )


@dataclass
class BackboneRun:
    """What one pass over the backbone layers produced."""

    streams: torch.Tensor  # [B,S,hc,D] output of the last block
    pre_mix: torch.Tensor  # [B,S,hc] collapse weights for the final norm
    all_streams: tuple[torch.Tensor, ...] | None  # embedding streams, then every block's output
    router_logits: list[torch.Tensor]
    experts: list[torch.Tensor]
    taps: list[torch.Tensor]  # DSpark taps in dspark_target_layer_ids order
    positions: torch.Tensor  # [B, T] positions of the tokens the last layers ran on (the taps' positions)
