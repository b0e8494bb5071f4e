"""generate() for DeepSeek-V4.1: a DeepseekV41Cache for every generation, DSpark speculative decoding
(`use_dspark`) and CUDA-graph decode steps (`cuda_graphs=True`)."""

from __future__ import annotations

import time

import torch
from transformers import GenerationMixin

from ..cache.cache import DeepseekV41Cache
from ..cache.graph_decoder import GenerationGraphs, check_graph_decoding
from .dspark import DSparkCandidateGenerator, dspark_generation_config


class DeepseekV41GenerationMixin(GenerationMixin):
    """transformers' generation with this model's cache, drafter and graph decoder."""

    @property
    def has_dspark(self) -> bool:
        """Whether the DSpark drafter's weights (`mtp.*`) are part of this model."""
        return len(self.mtp) > 0

    def generate(self, *args, **kwargs):
        """transformers' generate(), plus DSpark speculative decoding: `use_dspark=True` (a generation-config
        field, also settable in generation_config.json) and `dspark_confidence_threshold`. Afterwards
        `model.last_generation_stats` holds the run's measured speed, cache size and draft acceptance.
        `cuda_graphs=True` replays the one-token decode steps from a CUDA graph (greedy or sampling, batch of any
        size, on a CUDA device; not with DSpark or beam search)."""
        cuda_graphs = bool(kwargs.pop("cuda_graphs", False))
        if cuda_graphs:
            check_graph_decoding(self)
        use_dspark = kwargs.pop("use_dspark", None)
        threshold = kwargs.pop("dspark_confidence_threshold", None)
        base = kwargs.pop("generation_config", None)
        if use_dspark is not None or threshold is not None or getattr(base or self.generation_config, "use_dspark",
                                                                          False):
            config = dspark_generation_config(self, base, use_dspark, threshold)
            kwargs = config.update(**kwargs)  # generation settings go into the copy, the rest stay model inputs
            kwargs["generation_config"] = config
        elif base is not None:
            kwargs["generation_config"] = base
        self._generation_cache, self._dspark_generator = None, None
        self._cuda_graphs_requested, self._generation_graphs = cuda_graphs, None
        start = time.perf_counter()
        try:
            output = super().generate(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            cache, generator = self._generation_cache, self._dspark_generator
            if self._generation_graphs is not None:
                self._generation_graphs.close()
            self._generation_cache, self._dspark_generator = None, None
            self._cuda_graphs_requested, self._generation_graphs = False, None
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        prompt = args[0] if args else kwargs.get("input_ids")
        new_tokens = sequences.numel() - (prompt.numel() if isinstance(prompt, torch.Tensor) else 0)
        self.last_generation_stats = {
            "new_tokens": int(new_tokens), "seconds": elapsed, "tokens_per_second": new_tokens / max(elapsed, 1e-9),
            "cache_global_bytes_per_token": cache.global_bytes_per_token() if cache is not None else None,
            "dspark_mean_accepted_length": generator.mean_accepted_length if generator is not None else None,
            "dspark_rounds": generator.rounds if generator is not None else None,
        }
        return output

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor,
                                 model_kwargs, *args, **kwargs):
        if getattr(generation_config, "use_dspark", False):
            self._dspark_generator = DSparkCandidateGenerator(self, generation_config, logits_processor)
            return self._dspark_generator
        return super()._get_candidate_generator(generation_config, input_ids, inputs_tensor, logits_processor,
                                                model_kwargs, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """generate() gets a DeepseekV41Cache (the dynamic caches of transformers cannot hold CSA2 pools)."""
        dspark = bool(getattr(generation_config, "use_dspark", False))
        if self._cuda_graphs_requested:
            if dspark or generation_config.num_beams > 1:
                raise ValueError("cuda_graphs=True replays one-token steps: it cannot be combined with use_dspark "
                                 "or beam search (num_beams > 1).")
            if generation_config.use_cache is False:
                raise ValueError("cuda_graphs=True needs the cache: do not combine it with use_cache=False.")
        if model_kwargs.get("cache") is not None:
            cache = self._generation_cache = model_kwargs["cache"]
            cache._is_user_defined = True
            if dspark and not cache.dspark:
                raise ValueError("use_dspark needs a cache created with DeepseekV41Cache(config, dspark=True).")
            if self._cuda_graphs_requested and cache.dspark:
                raise ValueError("cuda_graphs=True needs a cache without DSpark rings (DeepseekV41Cache(config)).")
        elif generation_config.use_cache is False:
            if dspark:
                raise ValueError("use_dspark needs the cache: do not combine it with use_cache=False.")
            return
        else:
            model_kwargs["cache"] = self._generation_cache = DeepseekV41Cache(self.config, dspark=dspark)
        if self._cuda_graphs_requested:
            self._generation_graphs = GenerationGraphs(self, self._generation_cache, generation_config.max_length)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """Images and their token types belong to the prefill only; later steps feed text tokens."""
        is_first = kwargs.get("is_first_iteration", False)
        cache = kwargs.get("cache")
        if cache is not None and cache.pending_replay:
            cache.check_extends(input_ids)
        continuing = cache is not None and cache.get_seq_length() > 0 and not is_first
        token_types = kwargs.pop("token_types", None)
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        if continuing:
            for key in ("pixel_values", "image_grids"):
                model_inputs.pop(key, None)
        elif token_types is not None:
            width = model_inputs["input_ids"].shape[1]
            model_inputs["token_types"] = token_types[:, -width:]
        return model_inputs
