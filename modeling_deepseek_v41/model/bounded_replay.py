"""CED's bounded replay (the paper's serving path for a long prefill, `prefill_mode="bounded_replay"`).

Every prompt token runs the encoder layers (those before the CSA2 plan's `decoder_start`) and the first decoder
layer's compress step: the decoder's pool depends on nothing else. Only the last `sliding_window` tokens run the
decoder layers, whose windows see only that replayed segment. Prefill costs about half; it is an approximation of
the exact prefill, measured in docs/ced.md.
"""

from __future__ import annotations

import torch

from ..layers.hyper_connections import initial_streams
from .forward_context import BackboneRun, ForwardContext


def run_bounded_replay(backbone, hidden: torch.Tensor, context: ForwardContext, replay: int) -> BackboneRun:
    """Run `backbone` (a `DeepseekV41Model`) over the embeddings `hidden` [B,S,D] with bounded replay: the encoder
    layers and the decoder's compress step over all S tokens, the decoder layers over the last `replay`."""
    decoder = backbone.plan.decoder_start
    streams, pre_mix = initial_streams(hidden, backbone.config.text_config.hc_mult)
    run = BackboneRun(streams, pre_mix, None, [], [], [], context.positions)
    streams, pre_mix = backbone.run_layers(range(decoder), streams, pre_mix, context, run)
    layer = backbone.layers[decoder]
    streams = backbone.apply_engram(decoder, streams, context)
    _, inv_freq = context.rotations[(layer.spec.rope_theta, layer.spec.use_yarn)]
    layer.compress_only(streams, pre_mix, context.positions, inv_freq, context.share)
    tail = context.tail(replay)
    tail.share.pool_ready.add(decoder)  # the decoder's own forward must not compress the replayed tokens again
    # each row's windows start at its first replayed position (padding, -1, never counts as the first)
    tail.share.window_floor = torch.where(tail.positions >= 0, tail.positions,
                                          torch.iinfo(tail.positions.dtype).max).amin(dim=1)
    run.taps = [tap[:, -replay:] for tap in run.taps]
    run.streams, run.pre_mix = backbone.run_layers(range(decoder, len(backbone.layers)), streams[:, -replay:],
                                                   pre_mix[:, -replay:], tail, run, engram_done=decoder)
    run.positions = tail.positions
    return run
