"""generate() options that must either work or be refused before any work: DSpark with beam search refused, and
the processor's `token_types` growing with the generated text (so that `use_cache=False` and `assistant_model=`
see one type per token). `cache_implementation` is resolved in generation.py."""

from __future__ import annotations

import torch
from transformers import GenerationMixin

TEXT_TOKEN_TYPE = -1


class GenerationOptionsMixin(GenerationMixin):
    """Checks generate()'s options against what this model does."""

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config") or self.generation_config
        check_generation_options(config, kwargs)
        return super().generate(*args, **kwargs)


def option(config, kwargs: dict, name: str, default=None):
    """The call's value of a generation option: a keyword argument wins over the generation config."""
    return kwargs[name] if name in kwargs else getattr(config, name, default)


def check_generation_options(config, kwargs: dict) -> None:
    """Refuse options this model would otherwise ignore, naming what to do instead."""
    if option(config, kwargs, "use_dspark", False) and (option(config, kwargs, "num_beams", 1) or 1) > 1:
        raise ValueError("use_dspark=True drafts for one greedy or sampled sequence; it cannot be combined with beam "
                         "search: pass num_beams=1, or use_dspark=False for beam search.")


def extend_token_types(token_types: torch.Tensor, num_new_tokens: int) -> torch.Tensor:
    """Generated tokens are text (type -1)."""
    if num_new_tokens <= 0:
        return token_types
    return torch.cat([token_types, token_types.new_full((token_types.shape[0], num_new_tokens), TEXT_TOKEN_TYPE)], 1)
