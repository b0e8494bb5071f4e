"""generate() for DeepSeek-V4.1: a DeepseekV41Cache for every generation, DSpark speculative decoding
(`use_dspark`), CUDA-graph decode steps (`cuda_graphs=True`) and the call's measured statistics.

What one generate() call needs across transformers' hooks and the forward (the graph decoder, the DSpark candidate
generator) is a `GenerationRun` held by the call's cache for the call's duration: nothing is stored on the model.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass

import torch
from transformers import GenerationMixin

from ...cache.cache import DeepseekV41Cache
from ...layers.vision import TOKEN_TYPE_IMAGE_START, TOKEN_TYPE_TEXT
from ..inputs import check_generate_inputs, prompt_rows
from .dspark import DSPARK_FIELDS, DSparkCandidateGenerator, dspark_generation_config
from .graph_decoder import check_graph_decoding
from .graph_store import DeepseekV41DecodeGraphs, GenerationGraphs
from .invalid_logits import CALL_CHECKER, StopOnInvalidLogits, with_invalid_logits_check

SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")


@dataclass
class GenerationRun:
    """One generate() call's helpers, reachable from its cache (`cache.generation_run`) while it runs."""

    cuda_graphs: bool = False
    graphs: GenerationGraphs | None = None  # replays the decode, verify and draft steps (cuda_graphs=True)
    drafter: DSparkCandidateGenerator | None = None  # drafts candidates (use_dspark=True)


class DeepseekV41GenerationMixin(GenerationMixin):
    """transformers' generation with this model's cache, drafter and graph decoder."""

    _get_logits_processor = with_invalid_logits_check(GenerationMixin._get_logits_processor)

    @property
    def decode_graphs(self) -> DeepseekV41DecodeGraphs:
        """The CUDA graphs `generate(cuda_graphs=True)` recorded, kept for later calls of the same shape:
        `model.decode_graphs.nbytes()` reports their device memory, `.release()` frees it."""
        graphs = self.__dict__.get("_decode_graphs")
        if graphs is None:
            graphs = self.__dict__["_decode_graphs"] = DeepseekV41DecodeGraphs()
        return graphs

    @property
    def has_dspark(self) -> bool:
        """Whether the DSpark drafter's weights (`mtp.*`) are part of this model."""
        return len(self.dspark) > 0

    def generate(self, *args, generation_stats: dict | None = None, cuda_graphs: bool = False, **kwargs):
        """transformers' generate(), plus DSpark speculative decoding: `use_dspark=True` (a generation-config
        field, also settable in generation_config.json), `dspark_confidence_threshold` and `dspark_min_accepted`
        (see DSparkCandidateGenerator). `cuda_graphs=True` replays the decode steps from CUDA graphs (greedy or sampling, batch of any size, on a CUDA device; with
        DSpark its drafts and verify steps too; not with beam search), kept in `model.decode_graphs` for later
        calls. Pass a dict as `generation_stats` to get the call's measured
        speed, cache size and draft acceptance in it. `cache_implementation`: None or "dynamic" (the model's own
        growing DeepseekV41Cache) or "static" (the same as `cuda_graphs=True`); others are refused."""
        types, mask = kwargs.get("token_types"), kwargs.get("attention_mask")
        if isinstance(types, torch.Tensor) and isinstance(mask, torch.Tensor) and types.shape == mask.shape:
            # padding is text, whatever a collator filled in (a pipeline pads every unknown key with 0)
            kwargs["token_types"] = types.masked_fill(mask == 0, TOKEN_TYPE_TEXT)
        check_generate_inputs(self.config, args, kwargs)
        implementation = kwargs.pop("cache_implementation", None)
        use_dspark = kwargs.pop("use_dspark", None)
        fields = {name: value for name in DSPARK_FIELDS if (value := kwargs.pop(name, None)) is not None}
        base = kwargs.pop("generation_config", None)
        config = base or self.generation_config
        if use_dspark is not None or fields or getattr(config, "use_dspark", False):
            config = dspark_generation_config(self, base, use_dspark, fields)
            kwargs = config.update(**kwargs)  # generation settings go into the copy, the rest stay model inputs
            kwargs["generation_config"] = config
        elif base is not None:
            kwargs["generation_config"] = base
        if getattr(config, "use_dspark", False) and (config.num_beams or 1) > 1:
            raise ValueError("use_dspark=True drafts for one greedy or sampled sequence; it cannot be combined with "
                             "beam search: pass num_beams=1, or use_dspark=False for beam search.")
        rows = prompt_rows(args, kwargs) * (getattr(config, "num_return_sequences", None) or 1)
        if getattr(config, "use_dspark", False) and rows > 1:
            raise ValueError(f"use_dspark=True drafts for one sequence at a time (per-row acceptance is not built); "
                             f"this call would decode {rows} rows. Call generate() once per prompt with "
                             "use_dspark=True, or decode the batch together with use_dspark=False (cuda_graphs=True "
                             "replays its one-token steps for any batch size).")
        cuda_graphs = self._resolve_cache_implementation(implementation, kwargs) or cuda_graphs
        if cuda_graphs:
            check_graph_decoding(self)
        if "past_key_values" in kwargs and kwargs.get("cache") is None:  # transformers' older name for `cache`
            kwargs["cache"] = kwargs.pop("past_key_values")
        cache = kwargs.get("cache")
        if isinstance(cache, DeepseekV41Cache):
            cache._is_user_defined = True  # transformers' mark for a cache the caller passed (it outlives the call)
        if cache is None and kwargs.get("use_cache", getattr(config, "use_cache", True)) is not False:
            cache = kwargs["cache"] = DeepseekV41Cache(self.config, dspark=bool(getattr(config, "use_dspark", False)))
        elif cache is None and cuda_graphs:
            raise ValueError("cuda_graphs=True needs the cache: do not combine it with use_cache=False.")
        run = GenerationRun(cuda_graphs=cuda_graphs)
        if isinstance(cache, DeepseekV41Cache):
            cache.generation_run = run
        checker = StopOnInvalidLogits(deferred=True)
        context = CALL_CHECKER.set(checker)
        start = time.perf_counter()
        try:
            output = super().generate(*args, **kwargs)
            checker.finish()
        finally:
            CALL_CHECKER.reset(context)
            elapsed = time.perf_counter() - start
            if run.graphs is not None:
                run.graphs.close()
            if isinstance(cache, DeepseekV41Cache):
                cache.generation_run = None
        stats = self._generation_stats(output, args, kwargs, elapsed, cache, run)
        if generation_stats is not None:
            generation_stats.update(stats)
        self._deprecated_last_stats = stats  # read only by the deprecated last_generation_stats; goes with it
        return output

    @property
    def last_generation_stats(self) -> dict | None:
        """Deprecated (removed in the next release): pass a dict as `generate(..., generation_stats=stats)`."""
        warnings.warn("model.last_generation_stats is deprecated and will be removed in the next release: pass a "
                      "dict as generate(..., generation_stats=stats) (or a pipeline's generate_kwargs) and read it.",
                      FutureWarning, stacklevel=2)
        return self.__dict__.get("_deprecated_last_stats")

    def _resolve_cache_implementation(self, implementation: str | None, kwargs: dict) -> bool:
        """Check the requested cache implementation (argument or generation config) and clear it from the config
        (generate() always gets a DeepseekV41Cache); returns whether it asks for static (CUDA-graph) decoding."""
        config = kwargs.get("generation_config") or self.generation_config
        implementation = implementation or getattr(config, "cache_implementation", None)
        if implementation not in SUPPORTED_CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by DeepSeek-V4.1, whose cache holds "
                "compressed CSA2 pools (DeepseekV41Cache): use None or 'dynamic' (the default growing cache) or "
                "'static' (fixed buffers replayed from a CUDA graph, the same as cuda_graphs=True; CUDA only)."
            )
        if implementation == "static" and self.device.type != "cuda":
            raise ValueError(
                f"cache_implementation='static' is DeepSeek-V4.1's CUDA-graph decoding (fixed cache buffers whose "
                f"one-token steps replay a recorded CUDA graph), which needs the model on a CUDA device; this one is "
                f"on {self.device}. On a GPU, load with device_map='cuda' (or call model.to('cuda')); on the CPU, "
                "leave cache_implementation unset (or 'dynamic'): the model's growing DeepseekV41Cache."
            )
        if getattr(config, "cache_implementation", None) is not None:
            config = copy.deepcopy(config)
            config.cache_implementation = None  # transformers would otherwise build its own cache from it
            kwargs["generation_config"] = config
        return implementation == "static"

    @staticmethod
    def _generation_stats(output, args, kwargs, elapsed: float, cache, run: GenerationRun) -> dict:
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        prompt = args[0] if args else kwargs.get("input_ids")
        new_tokens = sequences.numel() - (prompt.numel() if isinstance(prompt, torch.Tensor) else 0)
        drafter = run.drafter
        return {
            "new_tokens": int(new_tokens), "seconds": elapsed, "tokens_per_second": new_tokens / max(elapsed, 1e-9),
            "cache_global_bytes_per_token": cache.global_bytes_per_token() if cache is not None else None,
            "dspark_mean_accepted_length": drafter.mean_accepted_length if drafter is not None else None,
            "dspark_rounds": drafter.rounds if drafter is not None else None,
            "dspark_plain_steps": drafter.plain_steps if drafter is not None else None,
            "cuda_graphs_recorded": run.graphs.recorded if run.graphs is not None else None,
        }

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor,
                                 model_kwargs, *args, **kwargs):
        if getattr(generation_config, "use_dspark", False):
            drafter = DSparkCandidateGenerator(self, generation_config, logits_processor)
            run = model_kwargs["cache"].generation_run
            if run is not None:
                run.drafter = drafter
            return drafter
        return super()._get_candidate_generator(generation_config, input_ids, inputs_tensor, logits_processor,
                                                model_kwargs, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """generate() gets a DeepseekV41Cache (the dynamic caches of transformers cannot hold CSA2 pools)."""
        dspark = bool(getattr(generation_config, "use_dspark", False))
        cache = model_kwargs.get("cache")
        run = getattr(cache, "generation_run", None)
        cuda_graphs = run is not None and run.cuda_graphs
        if cuda_graphs and generation_config.num_beams > 1:
            raise ValueError("cuda_graphs=True replays steps on fixed buffers: it cannot be combined with beam "
                             "search (num_beams > 1), which reorders the cache's rows.")
        if cuda_graphs and generation_config.use_cache is False:
            raise ValueError("cuda_graphs=True needs the cache: do not combine it with use_cache=False.")
        if cache is None:
            if dspark:
                raise ValueError("use_dspark needs the cache: do not combine it with use_cache=False.")
            return
        if dspark and not cache.dspark:
            raise ValueError("use_dspark needs a cache created with DeepseekV41Cache(config, dspark=True).")
        if cuda_graphs:  # with DSpark, verify steps feed the token and its drafts
            widest = self.config.text_config.dspark_block_size + 1 if dspark else 1
            run.graphs = GenerationGraphs(self, cache, generation_config.max_length, widest)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """Images and their token types belong to the prefill only; later steps feed text tokens (token_types is
        sliced like input_ids: transformers slices only the token-type names it knows)."""
        is_first = kwargs.get("is_first_iteration", False)
        cache = kwargs.get("cache")
        if cache is not None and cache.pending_replay:
            cache.check_extends(input_ids)
        cached = cache.get_seq_length() if cache is not None else 0
        continuing = cached > 0 and not is_first
        token_types = kwargs.pop("token_types", None)
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        for key in ("pixel_values", "image_grids"):
            if continuing:
                model_inputs.pop(key, None)
            elif kwargs.get(key) is not None:  # an empty cache sees the image span: transformers drops the pixels
                model_inputs[key] = kwargs[key]  # of an assistant's first forward (is_first_iteration=False)
        if not continuing and token_types is not None:  # generated tokens are text: the prompt's types grow with the sequence
            width = model_inputs["input_ids"].shape[1]
            types = extend_token_types(token_types, input_ids.shape[-1] - token_types.shape[-1])
            model_inputs["token_types"] = types[:, -width:]
            if cached > 0 and model_inputs.get("pixel_values") is not None:  # a later turn: earlier images are cached
                model_inputs["pixel_values"], model_inputs["image_grids"] = uncached_images(
                    types, model_inputs["pixel_values"], model_inputs["image_grids"], types.shape[1] - width)
        return model_inputs


def uncached_images(token_types: torch.Tensor, pixel_values: torch.Tensor, image_grids: torch.Tensor,
                    cached: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The patches and grids of the images whose spans start after the first `cached` columns (the cache already
    holds the others: a conversation's later turn repeats its earlier images). None, None when all are cached."""
    rows, columns = (token_types == TOKEN_TYPE_IMAGE_START).nonzero(as_tuple=True)  # reading order, as the images
    if rows.numel() != image_grids.shape[0]:
        raise ValueError(f"token_types mark {rows.numel()} image spans but image_grids describes "
                         f"{image_grids.shape[0]} images; pass the processor's outputs for the same prompt.")
    new_part = token_types[:, cached:]
    first_span = torch.where(new_part == TOKEN_TYPE_IMAGE_START, 0, 1).cumprod(dim=1).bool()
    if bool(((new_part > TOKEN_TYPE_IMAGE_START) & first_span).any()):
        raise ValueError(f"The cache ends inside an image span (after column {cached}): a prompt continues a cache "
                         "only after a whole image. Crop the cache before the image (cache.crop) or use a new cache.")
    keep = columns >= cached
    patches = image_grids[:, 0] * image_grids[:, 1]
    patch_keep = torch.repeat_interleave(keep.to(pixel_values.device), patches.to(pixel_values.device))
    if not bool(keep.any()):
        return None, None
    return pixel_values[patch_keep], image_grids[keep]


def extend_token_types(token_types: torch.Tensor, num_new_tokens: int) -> torch.Tensor:
    """The prompt's token types followed by text for each generated token."""
    if num_new_tokens <= 0:
        return token_types
    text = token_types.new_full((token_types.shape[0], num_new_tokens), TOKEN_TYPE_TEXT)
    return torch.cat([token_types, text], 1)
