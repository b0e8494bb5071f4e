"""The store a forward without a cache uses: the store protocol (`layers/kv_store.py`) over the chunk alone,
thrown away with the forward. Pools stay dense and keep their gradients (straight-through FP4 QDQ), windows are
listed from the chunk."""

from __future__ import annotations

import torch

from ..kernels.numerics import fp4_dequantize_rows, straight_through
from ..kernels.sparse_attention import list_window
from ..layers.kv_store import CompressStep
from .ring import gather_rows


class ChunkStore:
    """What the layers of one cache-less forward read and write."""

    # -- the forward's bookkeeping: a chunk is all there is ---------------------------------------------------
    @property
    def no_host_reads(self) -> bool:
        return torch.compiler.is_compiling()  # a traced graph cannot read values back

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

    # -- the layers' calls ------------------------------------------------------------------------------------
    def write_pool(self, source: int, positions: torch.Tensor, compress: CompressStep, dtype: torch.dtype
                   ) -> DensePoolView:
        # rows as many as the chunk spans (one device read), unless traced: a traced graph cannot read them back
        chunk = compress(positions, None, torch.compiler.is_compiling())
        kv = straight_through(chunk.rotated, fp4_dequantize_rows(*chunk.kv_codes, chunk.rotated.dtype))
        keys = straight_through(chunk.keys, fp4_dequantize_rows(*chunk.key_codes, chunk.keys.dtype))
        return DensePoolView(kv, keys)  # the FP4 values, with the gradients of the values before FP4

    def window(self, layer_id: int, kv: torch.Tensor, positions: torch.Tensor, size: int,
               floor: torch.Tensor | None = None) -> ChunkWindow:
        return ChunkWindow(kv, positions, size, floor)


class DensePoolView:
    """A cache-less forward's pool: every row of the chunk, dense."""

    decodes_incrementally = False  # the chunk is the whole sequence: its indexers score every row
    stored = None

    def __init__(self, kv: torch.Tensor, keys: torch.Tensor) -> None:
        self.kv, self._keys = kv, keys  # [B, N, head_dim], [B, N, index_head_dim]

    def keys(self) -> torch.Tensor:
        return self._keys

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return gather_rows(self.kv, rows)


class ChunkWindow:
    """A cache-less forward's windows, listed from the chunk."""

    stored = None

    def __init__(self, kv: torch.Tensor, positions: torch.Tensor, size: int, floor: torch.Tensor | None) -> None:
        self.kv, self.positions, self.size, self.floor = kv, positions, size, floor

    def entries(self, queries: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Window entries [B,q,L,hd] of the chunk's queries `queries`, and their validity."""
        positions = self.positions[:, queries]
        # traced (export/compile): the chunk's length bounds every position without a cache, with no host read
        width = (min(self.size, positions.shape[1]) if torch.compiler.is_compiling()
                 else max(min(self.size, int(positions.amax()) + 1) if positions.numel() else 0, 0))
        _, valid, chunk_index = list_window(positions, self.size, width, self.floor, queries.start)
        index = torch.where(valid, chunk_index, 0)
        return gather_rows(self.kv, index.clamp_min(0)), valid
