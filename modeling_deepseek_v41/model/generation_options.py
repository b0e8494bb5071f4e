"""generate() options that must either work or be refused before any work: DSpark with beam search, unknown
`cache_implementation` values, and the processor's `token_types` growing with the generated text (so that
`use_cache=False` and `assistant_model=` see one type per token)."""

from __future__ import annotations

import torch
from transformers import GenerationMixin

# None: this model's own cache; "dynamic" is what transformers names it; "static": the static decode cache
KNOWN_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
TEXT_TOKEN_TYPE = -1


class GenerationOptionsMixin(GenerationMixin):
    """Checks generate()'s options against what this model does. The processor's `token_types` cover the prompt:
    each step gets the types of the tokens it runs, generated ones being text (as transformers slices
    `token_type_ids`), with or without the cache and in an assistant model."""

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config") or self.generation_config
        check_generation_options(config, kwargs)
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, *args, **kwargs) -> dict:
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        token_types, step_ids = model_inputs.get("token_types"), model_inputs.get("input_ids")
        if token_types is not None and step_ids is not None:
            types = extend_token_types(token_types, input_ids.shape[-1] - token_types.shape[-1])
            model_inputs["token_types"] = types[:, types.shape[-1] - step_ids.shape[-1]:]
        return model_inputs


def option(config, kwargs: dict, name: str, default=None):
    """The call's value of a generation option: a keyword argument wins over the generation config."""
    return kwargs[name] if name in kwargs else getattr(config, name, default)


def check_generation_options(config, kwargs: dict) -> None:
    """Refuse options this model would otherwise ignore, naming what to do instead."""
    if option(config, kwargs, "use_dspark", False) and (option(config, kwargs, "num_beams", 1) or 1) > 1:
        raise ValueError("use_dspark=True drafts for one greedy or sampled sequence; it cannot be combined with beam "
                         "search: pass num_beams=1, or use_dspark=False for beam search.")
    cache_implementation = option(config, kwargs, "cache_implementation")
    if cache_implementation not in KNOWN_CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation={cache_implementation!r} is not available for DeepSeek-V4.1: it "
                         f"always decodes with its own DeepseekV41Cache; use one of {KNOWN_CACHE_IMPLEMENTATIONS}.")


def extend_token_types(token_types: torch.Tensor, num_new_tokens: int) -> torch.Tensor:
    """Generated tokens are text (type -1)."""
    if num_new_tokens <= 0:
        return token_types
    return torch.cat([token_types, token_types.new_full((token_types.shape[0], num_new_tokens), TEXT_TOKEN_TYPE)], 1)
