"""The layer plan: what every layer computes, shares and reads, derived once from the text config.

CSA2 wiring in one place. A layer with a non-zero compress ratio attends over a compressed KV pool; only the
KV-source layers ("Full") compress and own a pool and its index keys. Index sources score the pool and publish
a top-k selection; the other layers of that ratio ("Reuse") read the latest pool and the latest selection.
Index sources after the candidate source that own no keys ("Reindex") score only inside its candidate blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class CSA2Role(StrEnum):
    """What a layer does in the CSA2 schedule (equal to its plain string, e.g. `CSA2Role.FULL == "full"`)."""

    WINDOW = "window"  # sliding window only (ratio 0)
    FULL = "full"  # the pool owner: compresses into its pool, owns the index keys, scores them for a top-k
    REUSE = "reuse"  # reads the latest pool and the latest top-k; computes only its own queries and window KV
    REINDEX = "reindex"  # its own indexer over another layer's pool and keys, inside the candidate blocks
    DSPARK = "dspark"  # a DSpark drafter block (window only)


# the names the roles had before the enum, kept for a release (each is the member, equal to the old string)
ROLE_WINDOW = CSA2Role.WINDOW
ROLE_FULL = CSA2Role.FULL
ROLE_REUSE = CSA2Role.REUSE
ROLE_REINDEX = CSA2Role.REINDEX
ROLE_DSPARK = CSA2Role.DSPARK


@dataclass(frozen=True)
class LayerSpec:
    """Everything one layer needs to know about its place in the schedule."""

    layer_id: int
    ratio: int
    role: CSA2Role
    pool_source: int | None  # the KV-source layer whose compressed pool this layer attends over
    topk_source: int | None  # the index-source layer whose top-k selection this layer uses
    is_index_source: bool
    owns_index_keys: bool
    is_candidate_source: bool
    uses_candidates: bool
    engram_slot: int | None  # position in engram_layer_ids, or None
    is_dspark_tap: bool  # the drafter reads the mean of this layer's input streams
    rope_theta: float
    use_yarn: bool

    @property
    def is_full(self) -> bool:
        """Full: the pool owner, which compresses each chunk into its pool and scores the pool for its top-k."""
        return self.role == CSA2Role.FULL

    @property
    def is_reuse(self) -> bool:
        """Reuse: attends over the latest pool's rows that the latest index source selected; no scoring."""
        return self.role == CSA2Role.REUSE

    @property
    def is_reindex(self) -> bool:
        """Reindex: scores another layer's pool with its own indexer (inside the candidate source's blocks)."""
        return self.role == CSA2Role.REINDEX

    @property
    def reads_pool(self) -> bool:
        """Any of the three pool roles: the layer attends over top-k rows of a compressed pool too."""
        return self.is_full or self.is_reuse or self.is_reindex

    @property
    def owns_pool(self) -> bool:
        return self.is_full


@dataclass(frozen=True)
class LayerPlan:
    """The schedule of the backbone and the DSpark blocks, validated.

    `layers` lists the backbone layers, `dspark_layers` the drafter blocks. Raises `ValueError` naming the
    offending layer and the rule when the config is inconsistent.
    """

    layers: tuple[LayerSpec, ...]
    dspark_layers: tuple[LayerSpec, ...]
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int | None
    engram_layers: tuple[int, ...]
    dspark_taps: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def decoder_start(self) -> int | None:
        """The first decoder layer of the CED split: the last pool owner, whose pool every later layer reads."""
        return self.kv_sources[-1] if self.kv_sources else None


    @classmethod
    def from_config(cls, config: Any) -> "LayerPlan":
        n = config.num_hidden_layers
        n_mtp = config.num_nextn_predict_layers
        ratios = list(config.compress_ratios)
        kv_sources = list(config.kv_source_layer_ids)
        index_sources = list(config.index_source_layer_ids)
        candidate = config.candidate_source_layer_id
        engram = list(config.engram_layer_ids)
        taps = list(config.dspark_target_layer_ids)

        def fail(msg: str) -> None:
            raise ValueError(f"Inconsistent DeepSeek-V4.1 layer schedule: {msg}")

        if n <= 0:
            fail(f"num_hidden_layers must be positive, got {n}.")
        if len(ratios) != n + n_mtp:
            fail(
                f"compress_ratios has {len(ratios)} entries but num_hidden_layers + num_nextn_predict_layers = "
                f"{n} + {n_mtp} = {n + n_mtp} (one per backbone layer, then one per DSpark block)."
            )
        for i, r in enumerate(ratios):
            if not isinstance(r, int) or r < 0:
                fail(f"layer {i}: compress ratio must be a non-negative integer, got {r!r}.")
        for m in range(n_mtp):
            if ratios[n + m] != 0:
                fail(f"DSpark block {m} (compress_ratios[{n + m}]): DSpark blocks are window-only, ratio must be 0.")
        for name, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources),
                          ("engram_layer_ids", engram), ("dspark_target_layer_ids", taps)):
            if sorted(set(ids)) != ids:
                fail(f"{name} must be strictly increasing without repeats, got {ids}.")
            for i in ids:
                if not 0 <= i < n:
                    what = "DSpark target" if name == "dspark_target_layer_ids" else name
                    fail(f"{what} layer {i} is outside the backbone (layers 0..{n - 1}).")
        if len(config.engram_num_embeddings) != len(engram):
            fail(
                f"engram_num_embeddings has {len(config.engram_num_embeddings)} entries but engram_layer_ids "
                f"has {len(engram)}."
            )
        for i in kv_sources + index_sources:
            if ratios[i] == 0:
                fail(f"layer {i} is listed as a KV/index source but has compress ratio 0 (window only).")
        for i in kv_sources:
            if i not in index_sources:
                fail(f"layer {i} is a KV source but not an index source; a pool owner must also index it.")
        if candidate is not None:
            if not 0 <= candidate < n:
                fail(f"candidate_source_layer_id {candidate} is outside the backbone (layers 0..{n - 1}).")
            if candidate not in index_sources:
                fail(f"candidate source layer {candidate} must be an index source.")
        if n_mtp > 0 and config.dspark_block_size > 0 and not taps:
            fail("DSpark blocks are configured but dspark_target_layer_ids is empty.")

        yarn = config.yarn_original_max_position_embeddings > 0
        specs = []
        latest_pool: int | None = None
        latest_index: int | None = None
        for i in range(n):
            r = ratios[i]
            if i in kv_sources:
                latest_pool = i
            if i in index_sources:
                latest_index = i
            if r == 0:
                role, pool, topk_src = CSA2Role.WINDOW, None, None
            else:
                if latest_pool is None:
                    fail(f"layer {i} (ratio {r}) reads a compressed pool, but no KV-source layer at or before it "
                         "writes one.")
                if ratios[latest_pool] != r:
                    fail(f"layer {i} has ratio {r} but the pool it reads (written by layer {latest_pool}) has "
                         f"ratio {ratios[latest_pool]}.")
                pool = latest_pool
                if latest_index is None or latest_index < pool:
                    fail(f"layer {i} needs a top-k selection over layer {pool}'s pool, but no index source "
                         f"at or after layer {pool} precedes it.")
                topk_src = latest_index
                if ratios[topk_src] != r:
                    fail(f"layer {i} has ratio {r} but its top-k comes from layer {topk_src} with ratio "
                         f"{ratios[topk_src]}.")
                if i in kv_sources:
                    role = CSA2Role.FULL
                elif i in index_sources:
                    role = CSA2Role.REINDEX
                else:
                    role = CSA2Role.REUSE
            is_index = i in index_sources
            uses_candidates = is_index and candidate is not None and i > candidate
            if uses_candidates and pool != specs[candidate].pool_source:
                fail(f"index source {i} comes after candidate source {candidate} but reads layer {pool}'s pool, "
                     f"not the candidate source's (layer {specs[candidate].pool_source}).")
            specs.append(LayerSpec(
                layer_id=i, ratio=r, role=role, pool_source=pool, topk_source=topk_src,
                is_index_source=is_index, owns_index_keys=i in kv_sources,
                is_candidate_source=candidate == i, uses_candidates=uses_candidates,
                engram_slot=engram.index(i) if i in engram else None, is_dspark_tap=i in taps,
                rope_theta=float(config.compress_rope_theta if r else config.rope_theta),
                use_yarn=bool(r) and yarn,
            ))
        dspark = tuple(
            LayerSpec(
                layer_id=n + m, ratio=0, role=CSA2Role.DSPARK, pool_source=None, topk_source=None,
                is_index_source=False, owns_index_keys=False, is_candidate_source=False, uses_candidates=False,
                engram_slot=None, is_dspark_tap=False, rope_theta=float(config.rope_theta), use_yarn=False,
            )
            for m in range(n_mtp)
        )
        return cls(
            layers=tuple(specs), dspark_layers=dspark, kv_sources=tuple(kv_sources),
            index_sources=tuple(index_sources), candidate_source=candidate, engram_layers=tuple(engram),
            dspark_taps=tuple(taps),
        )
