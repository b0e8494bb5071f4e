"""The state carried between forward calls: DeepseekV41Cache and the parts it owns (CSA2 pools, window rings,
carries, the column log with the Engram history), their packed storage, persistence to disk, and the two stores a
forward's layers run on (`CacheStore` over a cache, the cache-less `ChunkStore`)."""

from .cache import DEFAULT_CROP_HORIZON, DeepseekV41Cache

__all__ = ["DEFAULT_CROP_HORIZON", "DeepseekV41Cache"]
