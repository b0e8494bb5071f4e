"""The store a forward without a cache uses: the same interface as DeepseekV41Cache's per-layer access
(`kv_access.py`), over the chunk alone and thrown away with the forward. Pools stay dense and keep their
gradients (straight-through FP4 QDQ), windows are listed from the chunk."""

from __future__ import annotations

import torch

from ..kernels.numerics import fp4_dequantize_rows, straight_through
from .storage import gather_rows, list_window


class ChunkStore:
    """What the attention layers of one cache-less forward read and write."""

    decodes_incrementally = False
    fixed_shapes = False
    is_static = False
    dspark = False

    def __init__(self) -> None:
        self.pool_kv: dict[int, torch.Tensor] = {}  # source -> [B, N, head_dim], every row of the chunk

    # -- the forward's bookkeeping: a chunk is all there is ---------------------------------------------------
    def get_seq_length(self) -> int:
        return 0

    def begin_chunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, compute_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, None, int]:
        """(the ids to run, no positions: they follow from the attention mask, nothing replayed)."""
        return input_ids, None, 0

    def append_history(self, compressed: torch.Tensor, replayed: int = 0) -> torch.Tensor:
        return compressed

    def commit(self, input_ids: torch.Tensor, positions: torch.Tensor, replayed: int = 0) -> None:
        pass

    # -- per layer ----------------------------------------------------------------------------------------------
    def pool_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def carry(self, source: int) -> None:
        return None

    def store_pool(self, source: int, out, rotated: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   keys: torch.Tensor, key_codes, positions: torch.Tensor, key_dtype: torch.dtype) -> torch.Tensor:
        self.pool_kv[source] = straight_through(rotated, fp4_dequantize_rows(*kv, rotated.dtype))
        return straight_through(keys, fp4_dequantize_rows(*key_codes, keys.dtype))  # the FP4 values, keys' gradient

    def gather_pool(self, source: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return gather_rows(self.pool_kv[source], rows)

    def window_entries(self, layer_id: int, chunk_kv: torch.Tensor, positions: torch.Tensor, window: int,
                       floor: torch.Tensor | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's window entries [B,S,L,hd] from the chunk, and their validity."""
        # traced (export/compile): the chunk's length bounds every position without a cache, with no host read
        width = (min(window, positions.shape[1]) if torch.compiler.is_compiling()
                 else max(min(window, int(positions.amax()) + 1) if positions.numel() else 0, 0))
        _, valid, chunk_index = list_window(positions, window, width, floor, offset)
        index = torch.where(valid, chunk_index, 0)
        return gather_rows(chunk_kv, index.clamp_min(0)), valid

    def write_window(self, layer_id: int, chunk_kv: torch.Tensor, positions: torch.Tensor) -> None:
        pass

    def window_storage(self, layer_id: int, chunk_length: int) -> None:
        return None  # windows are listed from the chunk
