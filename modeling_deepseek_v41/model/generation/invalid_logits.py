"""generate() stops with an error when no logit of a row is finite (all NaN, +inf or -inf), instead of emitting
token 0 forever.

The check runs first among the logits processors, before transformers' own ones: `remove_invalid_values=True`
would otherwise turn the NaNs and infinities into numbers and hide them.
"""

from __future__ import annotations

import functools

import torch
from transformers import LogitsProcessor


class InvalidLogitsError(FloatingPointError):
    """The model produced no usable logits (no finite value) for some row."""


class StopOnInvalidLogits(LogitsProcessor):
    """Raises InvalidLogitsError when no logit of a row is finite (one host read per step)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        invalid = ~torch.isfinite(scores).any(dim=-1)
        if bool(invalid.any()):
            row = int(invalid.nonzero()[0])
            raise InvalidLogitsError(
                f"generate() stopped: every logit of row {row} is {non_finite_kind(scores[row])} after "
                f"{input_ids.shape[1]} tokens, so no token can be chosen. The weights or the input are broken: load "
                "with check_finite=True (the default) to find a non-finite weight, and check the dtype and device "
                "placement."
            )
        return scores


def non_finite_kind(row: torch.Tensor) -> str:
    """How a row without a finite value is made: NaN, +inf, -inf, or a mix."""
    for kind, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if bool(test(row).all()):
            return kind
    return "NaN or infinite"


def with_invalid_logits_check(get_logits_processor):
    """Wrap GenerationMixin._get_logits_processor so its list starts with StopOnInvalidLogits."""

    @functools.wraps(get_logits_processor)
    def wrapped(self, *args, **kwargs):
        processors = get_logits_processor(self, *args, **kwargs)
        processors.insert(0, StopOnInvalidLogits())
        return processors

    return wrapped
