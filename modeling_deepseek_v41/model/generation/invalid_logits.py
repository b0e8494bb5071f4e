"""generate() stops with an error when no logit of a row is finite (all NaN, +inf or -inf), instead of emitting
token 0 forever.

The check runs first among the logits processors, before transformers' own ones: `remove_invalid_values=True`
would otherwise turn the NaNs and infinities into numbers and hide them. On a CUDA device reading the verdict back
at once would stall the host on every call (six per DSpark round), so generate()'s checker queues it (a
non-blocking copy to pinned memory) and reads it once it has landed: at a later call, or when generate() ends.
"""

from __future__ import annotations

import contextvars
import functools

import torch
from transformers import LogitsProcessor


class InvalidLogitsError(FloatingPointError):
    """The model produced no usable logits (no finite value) for some row."""


class StopOnInvalidLogits(LogitsProcessor):
    """Raises InvalidLogitsError when no logit of a row is finite.

    deferred=False reads each call's verdict at once (one host read per call); deferred=True (generate()'s own
    checker, on CUDA logits) reads verdicts once their copies have landed and `finish()` reads the rest, so the
    error comes at the latest when generate() returns."""

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event, torch.Tensor, int]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        finite = torch.isfinite(scores).any(dim=-1)
        if not (self.deferred and scores.is_cuda):
            _raise_if_invalid(finite, scores, input_ids.shape[1])
            return scores
        self._read_landed(wait=False)
        host = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(finite, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(scores.device))
        # a snapshot: later processors may write over `scores` (assisted decoding processes them in place)
        self._pending.append((host, landed, scores.clone(), input_ids.shape[1]))
        return scores

    def finish(self) -> None:
        """Read every verdict still in flight (waits for them): the end of a generate() call."""
        self._read_landed(wait=True)

    def _read_landed(self, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][1].query()):
            host, landed, scores, tokens = self._pending.pop(0)
            landed.synchronize()
            _raise_if_invalid(host, scores, tokens)


def _raise_if_invalid(finite: torch.Tensor, scores: torch.Tensor, tokens: int) -> None:
    invalid = ~finite
    if bool(invalid.any()):
        row = int(invalid.nonzero()[0])
        raise InvalidLogitsError(
            f"generate() stopped: every logit of row {row} is {non_finite_kind(scores[row])} after {tokens} "
            "tokens, so no token can be chosen. The weights or the input are broken: load with check_finite=True "
            "(the default) to find a non-finite weight, and check the dtype and device placement."
        )


def non_finite_kind(row: torch.Tensor) -> str:
    """How a row without a finite value is made: NaN, +inf, -inf, or a mix."""
    for kind, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if bool(test(row).all()):
            return kind
    return "NaN or infinite"


# the checker of the generate() call running in this context (set by DeepseekV41GenerationMixin.generate)
CALL_CHECKER: contextvars.ContextVar[StopOnInvalidLogits | None] = contextvars.ContextVar("invalid_logits_checker",
                                                                                         default=None)


def with_invalid_logits_check(get_logits_processor):
    """Wrap GenerationMixin._get_logits_processor so its list starts with the call's checker (or, outside a
    generate() call, a checker that reads each verdict at once)."""

    @functools.wraps(get_logits_processor)
    def wrapped(self, *args, **kwargs):
        processors = get_logits_processor(self, *args, **kwargs)
        processors.insert(0, CALL_CHECKER.get() or StopOnInvalidLogits())
        return processors

    return wrapped
