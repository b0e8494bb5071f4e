"""DSpark speculative decoding inside generate(): the candidate generator and the `use_dspark` switch."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator

from .dspark_drafting import dspark_draft


def dspark_generation_config(model, generation_config: GenerationConfig | None, use_dspark: bool | None,
                             threshold: float | None) -> GenerationConfig:
    """A copy of the generation config with the DSpark fields set. Drafting runs through transformers' assisted
    decoding, which the config's `use_mtp` flag selects; the drafter is then ours (see `_get_candidate_generator`)."""
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    if use_dspark is not None:
        config.use_dspark = use_dspark
    if threshold is not None:
        config.dspark_confidence_threshold = threshold
    if getattr(config, "use_dspark", False):
        if not model.has_dspark:
            raise ValueError(
                "use_dspark=True needs the DSpark drafter's weights (the checkpoint's mtp.* tensors), and this "
                "model has none. Load a checkpoint that includes them, or generate without use_dspark."
            )
        config.use_mtp = True
    return config


def verify_count(confidence: torch.Tensor, threshold: float) -> int:
    """How many drafted tokens to send for verification: the leading run whose cumulative product of
    sigmoid(confidence) stays at or above `threshold`. Draft i's confidence is computed from the token before
    it, never from draft i itself. Threshold 0 verifies every draft."""
    if threshold <= 0:
        return confidence.shape[-1]
    survival = torch.cumprod(torch.sigmoid(confidence.float()), dim=-1)
    return int((survival >= threshold).all(dim=0).cumprod(dim=-1).sum())


class DSparkCandidateGenerator(CandidateGenerator):
    """Drafts `dspark_block_size` tokens per drafter forward from the model's own cache.

    The drafter rings are fed inside the model's forward with every processed position, and cropped with the
    cache when drafts are rejected. Draft tokens are sampled in order from the (processed) Markov-biased draft
    logits, which are returned as the draft distribution so that speculative sampling stays lossless.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict = {}

    def __init__(self, model, generation_config: GenerationConfig, logits_processor=None) -> None:
        self.model = model
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.threshold = float(getattr(generation_config, "dspark_confidence_threshold", 0.0) or 0.0)
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict | None = None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0, **kwargs):
        if is_first_iteration:  # the model's own prefill comes first; drafting needs its cache
            return input_ids, None
        cache = model_kwargs["cache"]
        processed = []

        def choose(scores: torch.Tensor, index: int) -> torch.Tensor:
            context = torch.cat([input_ids] + [t.unsqueeze(1) for t in chosen], dim=1)
            if self.logits_processor is not None and len(self.logits_processor) > 0:
                scores = self.logits_processor(context, scores.clone())
            processed.append(scores)
            if self.do_sample:
                token = torch.multinomial(scores.softmax(dim=-1), 1).squeeze(1)
            else:
                token = scores.argmax(dim=-1)
            chosen.append(token)
            return token

        chosen: list[torch.Tensor] = []
        with torch.no_grad():
            draft = dspark_draft(self.model, input_ids[:, -1], cache, choose)
        count = verify_count(draft.confidence, self.threshold)
        self.drafted += count
        self.rounds += 1
        if count == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, draft.ids[:, 1:1 + count]], dim=1)
        return candidates, torch.stack(processed[:count], dim=1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.accepted += int(num_matches)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification round: the accepted drafts plus the model's own token."""
        return 1.0 + self.accepted / max(self.rounds, 1)
