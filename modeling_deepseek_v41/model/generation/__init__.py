"""Generation: `generate()` (the mixin), DSpark drafting and its candidate generator, the CUDA-graph decoder and the
invalid-logits check. It runs the model; the model's forward never reaches here."""

from .dspark import DSparkCandidateGenerator
from .graph_decoder import DeepseekV41CUDAGraphDecoder
from .graph_store import DeepseekV41DecodeGraphs
from .invalid_logits import InvalidLogitsError
from .mixin import DeepseekV41GenerationMixin

__all__ = ["DSparkCandidateGenerator", "DeepseekV41CUDAGraphDecoder", "DeepseekV41DecodeGraphs",
           "DeepseekV41GenerationMixin", "InvalidLogitsError"]
