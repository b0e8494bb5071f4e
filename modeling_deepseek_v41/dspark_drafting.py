"""DSpark drafting: feed the drafter's rings from the backbone taps, and draft a block of tokens in one forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .hyper_connections import hc_collapse
from .rope import rope_angles


class Draft(NamedTuple):
    ids: torch.Tensor  # [B, block+1]: the given next token, then the drafted tokens
    logits: torch.Tensor  # [B, block, V] fp32, Markov bias included
    confidence: torch.Tensor  # [B, block] raw confidence scores (no sigmoid)


def feed_dspark_rings(model, taps: torch.Tensor, positions: torch.Tensor, rotation: torch.Tensor, cache) -> None:
    """Write every processed position's drafter window KV (from the projected taps) into each stage's ring."""
    first = model.mtp[0]
    main_x = first.main_norm(first.main_proj(taps))
    for block in model.mtp:
        cache.write_window(block.spec.layer_id, block.attn.tap_kv(main_x, rotation), positions)


def dspark_draft(model, next_ids: torch.Tensor, cache,
                 choose: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> Draft:
    """One drafter forward after the backbone has processed every position up to each row's last one.

    `next_ids` [B] is the backbone's token for the following position. The block [next, noise, ...] runs through
    the stages at positions p+1 .. p+block; the last stage's logits get the Markov bias of the token before
    each position, and `choose(logits, i)` (argmax by default) picks the drafted token i from them in order.
    """
    text = model.config.text_config
    size = text.dspark_block_size
    last = cache.lengths - 1  # each row's last processed position
    block_ids = next_ids.new_full((next_ids.shape[0], size), text.dspark_noise_token_id)
    block_ids[:, 0] = next_ids
    streams, pre_mix = model._initial_streams(model.embed(block_ids))
    positions = last.unsqueeze(1) + 1 + torch.arange(size, device=last.device)
    spec = model.mtp[0].spec
    rotation = rope_angles(positions, model._inv_freq(spec.rope_theta, spec.use_yarn, positions.device))
    for block in model.mtp:
        window_kv, window_valid = cache.drafter_window(block.spec.layer_id, last, text.sliding_window, streams.dtype)
        streams, pre_mix, _, _ = block(streams, pre_mix, None, rotation, window_kv, window_valid)
    final = model.mtp[-1]
    hidden = hc_collapse(streams, pre_mix)
    logits = model.head(final.norm(hidden))
    choose = choose or (lambda scores, _: scores.argmax(dim=-1))
    ids, embeddings = [next_ids], []
    for i in range(size):
        bias, embedding = final.markov_head(ids[-1])
        logits[:, i] = logits[:, i] + bias
        embeddings.append(embedding)
        ids.append(choose(logits[:, i], i))
    confidence = final.confidence_head(hidden, torch.stack(embeddings, dim=1))
    return Draft(torch.stack(ids, dim=1), logits, confidence)
