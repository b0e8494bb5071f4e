"""The backbone's forward: what the layers of one forward share (ForwardContext), and the runner that takes the
embeddings through Engram, the DSpark taps and every block (whole, or with CED's bounded replay)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.chunk_store import ChunkStore
from ..layers.attention import ForwardShare
from ..layers.engram import prefetch_engram_rows
from ..layers.engram_hashing import DEAD, engram_hash_ids, ngram_window
from ..layers.vision import embed_images, merge_image_embeddings
from ..kernels.numerics import compute_dtype


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


def initial_streams(hidden: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings copied into the hc streams, and the one-hot collapse weights of the first block."""
    streams = hidden.unsqueeze(2).repeat(1, 1, hc_mult, 1)
    pre_mix = torch.zeros(*streams.shape[:3], dtype=compute_dtype(streams), device=streams.device)
    pre_mix[..., 0] = 1.0
    return streams, pre_mix


class DeepseekV41BackboneMixin:
    """The backbone's forward pieces, on the model that holds `embed`, `layers`, `plan`, `rotary` and (with
    Engram) `engram_layout` and `engram_token_map`."""

    def engram_rows(self, input_ids: torch.Tensor, dead: torch.Tensor | None, store=None, replayed: int = 0
                    ) -> torch.Tensor:
        """Global Engram table rows [B,S,n_engram_layers,columns] of every position of `input_ids`; with a cache
        as the `store`, n-grams reach back into the cached history."""
        store = ChunkStore() if store is None else store
        token_map = self.engram_token_map
        if not torch.compiler.is_compiling() and not store.is_static and bool((token_map < 0).any()):  # host read
            raise RuntimeError(
                "The Engram compressed token map has not been built. Load the model with from_pretrained from a "
                "folder that has the tokenizer files, or call model.build_engram_token_map(tokenizer)."
            )
        text = self.config.text_config
        compressed = token_map[input_ids]
        if dead is not None:
            compressed = compressed.masked_fill(dead, DEAD)
        history = store.append_history(compressed, replayed)
        pad = token_map[text.engram_pad_token_id]
        shifted = ngram_window(history, pad, text.engram_max_ngram_size, input_ids.shape[1])
        primes, offsets, multipliers = self.engram_layout.tensors_on(input_ids.device)
        return engram_hash_ids(shifted, primes, offsets, multipliers)

    def prepare_context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        token_types: torch.Tensor | None = None, record_selection: bool = False,
                        store=None, positions: torch.Tensor | None = None, replayed: int = 0) -> ForwardContext:
        """Everything the layers share for one forward: positions (-1 at padding), RoPE rotations, Engram rows,
        image mask and the per-forward CSA2 share. `store` is the cache (whose `begin_chunk` gave `positions`)
        or, by default, a throw-away ChunkStore."""
        store = ChunkStore() if store is None else store
        batch, seq = input_ids.shape
        device = input_ids.device
        if positions is None:
            if attention_mask is None:
                positions = torch.arange(seq, device=device).expand(batch, seq)
            else:
                mask = attention_mask[:, -seq:].to(torch.bool)
                positions = torch.where(mask, mask.long().cumsum(-1) - 1, -1)
        padding = positions < 0
        # an all-False mask changes nothing; only eager, growing-cache calls read it back to skip the masking
        keep = torch.compiler.is_compiling() or store.is_static
        padding = padding if keep or bool(padding.any()) else None
        image_mask = token_types >= 0 if token_types is not None else None
        dead = image_mask
        if padding is not None:
            dead = padding if dead is None else dead | padding
        rotations = self.rotary.rotations(positions)
        engram_rows = self.engram_rows(input_ids, dead, store, replayed) if self.plan.engram_layers else None
        if engram_rows is not None:  # host/mmap tables: start gathering their rows before the first layer
            prefetch_engram_rows(self, engram_rows)
        else:
            store.append_history(torch.full_like(input_ids, DEAD), replayed)
        return ForwardContext(
            positions=positions, rotations=rotations, engram_rows=engram_rows,
            engram_live=None if dead is None else ~dead, image_mask=image_mask,
            share=ForwardShare(record_selection=record_selection, store=store),
        )

    def layer_step(self, index: int, streams: torch.Tensor, pre_mix: torch.Tensor, context: ForwardContext
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run backbone block `index` on streams that already went through its Engram."""
        layer = self.layers[index]
        angles, inv_freq = context.rotations[(layer.spec.rope_theta, layer.spec.use_yarn)]
        return layer(streams, pre_mix, context.image_mask, context.positions, angles, inv_freq, context.share)

    def apply_engram(self, index: int, streams: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        layer = self.layers[index]
        if layer.spec.engram_slot is None:
            return streams
        rows = context.engram_rows[:, :, layer.spec.engram_slot]
        return layer.engram(streams, rows, context.engram_live)

    def _run_layers(self, layers: range, streams: torch.Tensor, pre_mix: torch.Tensor, context: ForwardContext,
                    run: BackboneRun, engram_done: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Engram, DSpark tap and block of each layer in `layers`, recording into `run`."""
        for index in layers:
            if index != engram_done:
                streams = self.apply_engram(index, streams, context)
            if self.layers[index].spec.is_dspark_tap:
                run.taps.append(streams.mean(dim=2))
            streams, pre_mix, logits, experts = self.layer_step(index, streams, pre_mix, context)
            run.router_logits.append(logits)
            run.experts.append(experts)
            if run.all_streams is not None:
                run.all_streams += (streams,)
        return streams, pre_mix

    def run_backbone(self, hidden: torch.Tensor, context: ForwardContext, output_hidden_states: bool = False
                     ) -> BackboneRun:
        """Expand the embeddings into the hc streams and run every backbone layer (Engram, DSpark tap, block)."""
        streams, pre_mix = initial_streams(hidden, self.config.text_config.hc_mult)
        run = BackboneRun(streams, pre_mix, (streams,) if output_hidden_states else None, [], [], [],
                          context.positions)
        run.streams, run.pre_mix = self._run_layers(range(len(self.layers)), streams, pre_mix, context, run)
        return run

    def run_backbone_bounded(self, hidden: torch.Tensor, context: ForwardContext, replay: int) -> BackboneRun:
        """CED prefill with bounded replay: every token runs the encoder layers and the first decoder layer's
        compressor (the decoder's pool depends on nothing else); only the last `replay` tokens run the decoder
        layers, whose windows see only the replayed segment."""
        decoder = self.plan.decoder_start
        streams, pre_mix = initial_streams(hidden, self.config.text_config.hc_mult)
        run = BackboneRun(streams, pre_mix, None, [], [], [], context.positions)
        streams, pre_mix = self._run_layers(range(decoder), streams, pre_mix, context, run)
        layer = self.layers[decoder]
        streams = self.apply_engram(decoder, streams, context)
        _, inv_freq = context.rotations[(layer.spec.rope_theta, layer.spec.use_yarn)]
        layer.compress_only(streams, pre_mix, context.positions, inv_freq, context.share)
        tail = context.tail(replay)
        tail.share.pool_ready.add(decoder)
        tail.share.window_floor = torch.where(tail.positions >= 0, tail.positions,
                                              torch.iinfo(tail.positions.dtype).max).amin(dim=1)
        run.taps = [tap[:, -replay:] for tap in run.taps]
        run.streams, run.pre_mix = self._run_layers(range(decoder, len(self.layers)), streams[:, -replay:],
                                                    pre_mix[:, -replay:], tail, run, engram_done=decoder)
        run.positions = tail.positions
        return run

    def embed_tokens(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                     pixel_values: torch.Tensor | None = None, image_grids: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Token embeddings with every image span overwritten: delimiters by the learned vectors, image slots by
        the ViT + aligner features in reading order."""
        hidden = self.embed(input_ids)
        if pixel_values is None:
            return hidden
        if not self.config.vision_enabled:
            raise ValueError("pixel_values were given but this checkpoint has no vision tower (vision_config).")
        if token_types is None or image_grids is None:
            raise ValueError("Images need the processor's token_types and image_grids next to pixel_values.")
        image_embeds = embed_images(self.vision, self.aligner, pixel_values, image_grids)
        return merge_image_embeddings(hidden, token_types, image_embeds, self.image_start, self.image_newline,
                                      self.image_end)
