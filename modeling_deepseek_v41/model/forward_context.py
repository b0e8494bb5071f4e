"""What one forward over the backbone shares, records and returns: the `ForwardContext` the layers of one forward
share (computed once before the first layer), the `BackboneRun` a pass over the layers records, and the base model's
output made from it (`DeepseekV41ModelOutput`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..layers.attention import ForwardShare
from ..layers.hyper_connections import hc_collapse


@dataclass
class DeepseekV41ModelOutput(BaseModelOutputWithPast):
    """The base model's output.

    last_hidden_state: [B,S,D] the final norm of the hc streams collapsed by the last block's weights (what
        `lm_head` reads). cache: the `DeepseekV41Cache` (with `use_cache`).
    hidden_states: with `output_hidden_states`, num_hidden_layers + 1 tensors [B,S,D]: the embeddings, then every
        block's output, each the mean over the hyper-connection streams (what the DSpark taps read; no final norm).
    hc_streams: with `output_hidden_states`, the same states unreduced: the streams [B,S,hc_mult,D].
    router_logits / router_experts: with `output_router_logits`, every layer's router scores and chosen experts.
    dspark_hidden: the DSpark tap (mean over streams of each target layer's input, concatenated) of the caller's
        tokens; None without DSpark target layers.
    """

    hc_streams: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    router_experts: tuple[torch.Tensor, ...] | None = None
    dspark_hidden: torch.Tensor | None = None


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

    def output(self, norm: nn.Module, hidden: torch.Tensor, tapped: torch.Tensor | None, replayed: int, cache,
               router: bool) -> DeepseekV41ModelOutput:
        """The base model's output for the caller's tokens (replayed ones only rebuilt windows): the final `norm`
        of the collapsed streams, with the embeddings `hidden`, the taps and the router's choices when recorded."""
        streams, pre_mix, all_streams = self.streams, self.pre_mix, self.all_streams
        if replayed:
            streams, pre_mix, hidden = streams[:, replayed:], pre_mix[:, replayed:], hidden[:, replayed:]
            tapped = None if tapped is None else tapped[:, replayed:]
            all_streams = None if all_streams is None else tuple(s[:, replayed:] for s in all_streams)
        return DeepseekV41ModelOutput(
            last_hidden_state=norm(hc_collapse(streams, pre_mix)), cache=cache,
            hidden_states=None if all_streams is None else (hidden,) + tuple(  # the embeddings (streams copy them)
                s.mean(dim=2) for s in all_streams[1:]),
            hc_streams=all_streams,
            router_logits=tuple(self.router_logits) if router else None,
            router_experts=tuple(self.experts) if router else None,
            dspark_hidden=tapped,
        )
