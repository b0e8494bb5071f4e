"""The state carried between forward calls: DeepseekV41Cache (CSA2 pools, window rings, carries, Engram history),
its packed storage, persistence to disk, and the CUDA-graph decoder that replays one-token steps on it."""

from .cache import DEFAULT_CROP_HORIZON, DeepseekV41Cache

__all__ = ["DEFAULT_CROP_HORIZON", "DeepseekV41Cache"]
