"""DeepseekV41Cache: the state between forward calls, as parts it owns (`parts.py`), with crop, row selection,
static decode, persistence and byte accounting; a forward reaches the parts through its `CacheStore`
(`cache_store.py`), the store protocol of `layers/kv_store.py`."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from ..config.layer_plan import LayerPlan
from .chunk import check_crop, check_make_static
from .columns import ColumnLog
from .fingerprint import cache_signature
from .layer_view import DeepseekV41LayerView
from .parts import allocate_parts, copy_state, parts_nbytes, same_layout
from .persistence import load_cache, save_cache
from .pool import Pool
from .ring import Ring
from .row_indices import check_row_indices

DEFAULT_CROP_HORIZON = 64


class DeepseekV41Cache(Cache):
    """The state DeepSeek-V4.1 carries between forward calls, in parts it owns: `pools` (per KV source, a Full
    layer: compressed KV rows, E2M1 + E4M3 scale per 16, 288 bytes per 512-wide row; index keys, E2M1 + E8M0 per
    32, 68 bytes per 128-wide row; for ratio r > 1 the fp32 carry of the open group), `rings` (per layer, and per
    drafter stage with `dspark=True`: an FP8 window ring, e4m3 + E8M0 per 32, 528 bytes per slot, of
    `sliding_window + crop_horizon` slots, so the cache can be cropped back that far exactly) and `log` (every
    column's token and Engram compressed ids, the per-row token counts).

    Positions are per batch row (left padding shifts them); `get_seq_length()` counts input columns, padding
    included, as `generate()` expects. Create it directly or let `generate()` do it.
    """

    def __init__(self, config, crop_horizon: int = DEFAULT_CROP_HORIZON, dspark: bool = False) -> None:
        self.text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        # one view per backbone layer: generate() reads len(cache) and the layers' kinds (attention, not recurrent)
        super().__init__(layers=[DeepseekV41LayerView(self, i) for i in range(self.text_config.num_hidden_layers)])
        self.dspark = dspark  # feed the DSpark drafter's rings from every processed position
        self.plan = LayerPlan.from_config(self.text_config)
        self.crop_horizon = crop_horizon
        self.config_signature = cache_signature(self.text_config)
        self.generation_run = None  # the helpers of the generate() call using this cache, while it runs
        self.reset()

    def reset(self) -> None:
        self.log: ColumnLog | None = None  # allocated by the first forward, with the pools and rings
        self.pools: dict[int, Pool] = {}
        self.rings: dict[int, Ring] = {}
        self.pending_replay = False  # a restored cache replays its last window of tokens on the next forward
        self.crop_floor = 0  # a restored cache cannot roll back past its restore point

    @property
    def is_initialized(self) -> bool:
        return self.log is not None

    @property
    def columns(self) -> int:
        """Input columns consumed (padding included)."""
        return self.log.columns if self.log is not None else 0

    @property
    def lengths(self) -> torch.Tensor | None:
        """[B] real tokens per batch row."""
        return self.log.lengths if self.log is not None else None

    @property
    def max_length(self) -> int:
        """The most real tokens any row holds, as a Python int (decode steps know it without a device read)."""
        return self.log.max_length if self.log is not None else 0

    @property
    def history(self) -> torch.Tensor:
        """[B, columns] compressed token ids of everything cached (DEAD at images and padding)."""
        return self.log.history.view(0, self.columns)

    def check_compatible(self, text_config) -> None:
        if cache_signature(text_config) != self.config_signature:
            raise ValueError("This DeepseekV41Cache was built for a model with another configuration; create a new "
                             "cache for this model (DeepseekV41Cache(model.config)) or pass cache=None.")

    def prepare_rows(self, batch: int, device: torch.device, model_dtype: torch.dtype) -> None:
        """Allocate every part for `batch` rows on the first forward; later forwards must bring as many rows."""
        if self.log is None:
            specs = self.plan.layers + (self.plan.dspark_layers if self.dspark else ())
            self.log, self.rings, self.pools = allocate_parts(specs, self.text_config, self.crop_horizon, batch,
                                                              device, model_dtype)
        if self.lengths.shape[0] != batch:
            raise ValueError(f"The cache holds {self.lengths.shape[0]} rows but the input has {batch}.")

    # -- the DSpark drafter's rings (the store protocol's `DrafterRings`) -------------------------------------
    def write_window(self, layer_id: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        self.rings[layer_id].write(kv, positions)

    def drafter_window(self, layer_id: int, last: torch.Tensor, window: int, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A drafter stage's window up to `last` [B] (values [B,L,hd], validity [B,L]), from its ring."""
        return self.rings[layer_id].drafter_window(last, window, self.max_length, dtype)

    # -- transformers' Cache API (its per-layer queries are answered by the layer views) --------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` columns (transformers' convention: a negative count; 0 is a no-op).

        Windows, carries, pools and histories return exactly to their earlier state within `crop_horizon`; a
        static cache crops its own steps in place (a DSpark verify step's rejected drafts)."""
        if tokens_to_remove > 0:
            raise ValueError("DeepseekV41Cache.crop takes a negative number of tokens to remove (or 0).")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        static_start = self.log.fixed_from if self.is_static else None
        check_crop(-tokens_to_remove, self.crop_horizon, self.columns, self.crop_floor, static_start)
        self.log.crop(-tokens_to_remove)
        for part in (*self.rings.values(), *self.pools.values()):
            part.crop(self.lengths)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:  # indices built here are valid by construction: no check, no host read
            self.batch_select_indices(torch.arange(self.lengths.shape[0]).repeat_interleave(repeats), False)

    def batch_select_indices(self, indices: torch.Tensor, validate: bool = True) -> None:
        """Keep (and reorder, repeat) the rows `indices` of every tensor the cache holds; `validate` checks the
        caller's indices first (one host read)."""
        if not self.is_initialized:
            return
        if self.is_static:
            raise ValueError("Cannot reorder a static cache's rows; call cache.end_static() first.")
        if validate:
            check_row_indices(indices, self.lengths.shape[0])
        indices = indices.to(self.lengths.device)
        for part in (self.log, *self.rings.values(), *self.pools.values()):
            part.select(indices)

    # -- static decode (CUDA graphs) ------------------------------------------------------------------------
    @property
    def is_static(self) -> bool:
        return self.static_columns is not None

    @property
    def static_columns(self) -> torch.Tensor | None:
        """[1, 1] the column count on the device, in static mode (None otherwise)."""
        return self.log.cursor if self.log is not None else None

    def make_static(self, columns: int) -> None:
        """Fix every buffer for decode steps (of 1 to crop_horizon + 1 tokens) until the cache holds `columns`
        columns: a step of a given width then runs the same kernels on the same memory with the same shapes (what a
        CUDA graph replays). Pool reads span the pools' capacity, masked by each query's visible rows, so a step's
        cost no longer follows the context."""
        check_make_static(self, columns)
        for part in (self.log, *self.pools.values(), *self.rings.values()):
            part.fix(columns)

    def static_parts(self) -> tuple:
        """(log, rings, pools): the buffers a static cache's recorded steps use, for `adopt_static_parts`."""
        return self.log, self.rings, self.pools

    def adopt_static_parts(self, parts: tuple) -> bool:
        """Move this static cache's state into `parts` (another static cache's, of the same capacity, rows and
        layers, whose recorded CUDA graphs then replay this cache's steps) and use them from now on. False, with
        nothing changed, when the layouts differ. `own_parts` ends the sharing."""
        if not self.is_static or not same_layout(parts, self.static_parts()):
            return False
        for into, source in zip(parts, self.static_parts()):
            copy_state(into, source)
        self.log, self.rings, self.pools = parts
        return True

    def own_parts(self) -> None:
        """Copies of the parts, so that the ones adopted (still held by their recorded graphs) stay with them."""
        self.log, self.rings, self.pools = copy.deepcopy(self.static_parts())

    def end_static(self) -> None:
        """Back to growing buffers (any forward is allowed again)."""
        if self.is_initialized:
            for part in (self.log, *self.pools.values(), *self.rings.values()):
                part.unfix()

    # -- persistence ----------------------------------------------------------------------------------------
    def save(self, path, model) -> "Path":
        """Save the prefix (global KV, carries, Engram history, token ids) to `path`, atomically."""
        return save_cache(self, path, model)

    @classmethod
    def load(cls, path, model, dspark: bool = False, crop_horizon: int | None = None) -> "DeepseekV41Cache":
        """Restore a saved prefix for `model`; its next forward first replays the last `sliding_window` tokens to
        rebuild the windows (bounded replay), then runs the new tokens."""
        return load_cache(cls, path, model, dspark=dspark, crop_horizon=crop_horizon or DEFAULT_CROP_HORIZON)

    def mark_restored(self) -> None:
        """This cache was just filled from a saved prefix (`persistence.py`, through its parts' `restore`): its next
        forward first replays the last `sliding_window` tokens to rebuild the windows, and no crop reaches back
        past this point."""
        self.pending_replay = True
        self.crop_floor = self.columns

    def check_extends(self, input_ids: torch.Tensor) -> None:
        """A restored prefix continues only with inputs that start with its saved tokens."""
        if not self.log.is_prefix_of(input_ids):
            raise ValueError(
                f"The input does not extend the restored prefix: its first {self.columns} tokens must equal the "
                "saved ones (pass the full sequence, prefix then suffix, to generate())."
            )

    # -- inspection -----------------------------------------------------------------------------------------
    def nbytes_by_component(self) -> dict[str, int]:
        """Bytes in use: the compressed pools and index keys (global KV), the window rings (as allocated), the
        carries and recent raw tokens kept for cropping, and the Engram history."""
        return parts_nbytes(self.log, self.pools, self.rings)

    def global_bytes_per_token(self) -> float:
        """Global (compressed) KV bytes per token of a row, averaged over rows."""
        tokens = int(self.lengths.sum()) if self.is_initialized else 0
        return self.nbytes_by_component()["global_kv"] / max(tokens, 1)

    def __repr__(self) -> str:
        return (f"DeepseekV41Cache(columns={self.columns}, pools={sorted(self.pools)}, "
                f"rings={len(self.rings)}, bytes={self.nbytes_by_component()})")

