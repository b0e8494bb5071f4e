"""DSpark drafting: draft a block of tokens in one forward of the drafter (`DeepseekV41DSpark`, whose rings the
backbone's forward feeds), and the candidate generator that runs it inside generate() (`use_dspark`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator


class Draft(NamedTuple):
    ids: torch.Tensor  # [B, block+1]: the given next token, then the drafted tokens
    logits: torch.Tensor  # [B, block, V] fp32, Markov bias included
    confidence: torch.Tensor  # [B, block] raw confidence scores (no sigmoid)


def draft_forward(model, next_ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's forward after the backbone has processed every position up to each row's last one: the block
    [next, noise, ...] (`next_ids` [B], the backbone's token for the following position) through the stages at
    positions p+1 .. p+block. Returns (hidden [B, block, D], logits [B, block, V] fp32 without the Markov bias)."""
    drafter, text = model.dspark, model.config.text_config
    size = text.dspark_block_size
    last = cache.lengths - 1  # each row's last processed position
    block_ids = next_ids.new_full((next_ids.shape[0], size), text.dspark_noise_token_id)
    block_ids[:, 0] = next_ids
    positions = last.unsqueeze(1) + 1 + torch.arange(size, device=last.device)

    def stage_window(stage, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.drafter_window(stage.spec.layer_id, last, text.sliding_window, dtype)  # the stage's ring

    hidden = drafter(model.get_input_embeddings()(block_ids), drafter.rotation(positions), stage_window)
    return hidden, drafter.logits(hidden, model.get_output_embeddings())


def choose_drafts(model, next_ids: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                  choose: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> Draft:
    """The drafted tokens from the drafter's forward: each position's logits get the Markov bias of the token
    before it, and `choose(logits, i)` (argmax by default) picks draft i from them, in order."""
    drafter = model.dspark
    choose = choose or (lambda scores, _: scores.argmax(dim=-1))
    ids, biased, embeddings = [next_ids], [], []
    for i in range(logits.shape[1]):  # `logits` is only read: it may be a replayed graph's output buffer
        bias, embedding = drafter.markov(ids[-1])
        biased.append(logits[:, i] + bias)
        embeddings.append(embedding)
        ids.append(choose(biased[-1], i))
    confidence = drafter.confidence(hidden, torch.stack(embeddings, dim=1))
    return Draft(torch.stack(ids, dim=1), torch.stack(biased, dim=1), confidence)


def dspark_draft(model, next_ids: torch.Tensor, cache,
                 choose: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> Draft:
    """One drafter forward and its drafted tokens (`draft_forward`, then `choose_drafts`)."""
    hidden, logits = draft_forward(model, next_ids, cache)
    return choose_drafts(model, next_ids, hidden, logits, choose)


class Verdict(NamedTuple):
    accepted: torch.Tensor  # [B] leading drafts the backbone agrees with
    targets: torch.Tensor  # [B, block+1] the backbone's greedy token after each verified position
    next_ids: torch.Tensor  # [B] the token after the accepted ones: the next round's first input


def greedy_verdict(draft_ids: torch.Tensor, verify_logits: torch.Tensor) -> Verdict:
    """Greedy acceptance on the device: draft_ids [B, block+1] (the given token, then the drafts) were run through
    the backbone, giving verify_logits [B, block+1, V]. A draft is kept while every draft before it is the
    backbone's own argmax; the round emits targets[:, :accepted + 1]. Nothing is read back to the host."""
    targets = verify_logits.argmax(dim=-1)
    agree = (draft_ids[:, 1:] == targets[:, :-1]).long()
    accepted = agree.cumprod(dim=-1).sum(dim=-1)
    return Verdict(accepted, targets, targets.gather(1, accepted.unsqueeze(1)).squeeze(1))


DSPARK_FIELDS = ("dspark_confidence_threshold", "dspark_min_accepted")  # generate() kwargs kept in the config
BACKOFF_LIMIT = 16  # plain steps at most between two drafting rounds while the drafts keep failing


def dspark_generation_config(model, generation_config: GenerationConfig | None, use_dspark: bool | None,
                             fields: dict) -> GenerationConfig:
    """A copy of the generation config with the DSpark fields set (`fields`: DSPARK_FIELDS given to generate()).
    Drafting runs through transformers' assisted decoding, which the config's `use_mtp` flag selects; the drafter
    is then ours (see `_get_candidate_generator`)."""
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    if use_dspark is not None:
        config.use_dspark = use_dspark
    for name, value in fields.items():
        setattr(config, name, value)
    least = getattr(config, "dspark_min_accepted", None)  # an argument, or a field of generation_config.json
    if least is not None and (isinstance(least, bool) or not isinstance(least, (int, float)) or not least >= 0):
        raise ValueError(f"dspark_min_accepted is the number of drafts a round must keep to draft again at once "
                         f"(0 drafts every round); got {least!r}. Pass a number >= 0.")
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
    cache when drafts are rejected. Greedy drafts are the argmax of the Markov-biased draft logits (the logits
    processors apply to the verified tokens); sampled drafts are drawn in order from the processed biased logits,
    which are returned as the draft distribution so that speculative sampling stays lossless. With
    `generate(cuda_graphs=True)` the drafter's forward (greedy: the whole draft) replays from a CUDA graph.

    A drafting round that keeps fewer than `dspark_min_accepted` drafts (default 1) is followed by plain one-token
    steps, 1, 2, 4, ... up to BACKOFF_LIMIT of them while rounds keep failing, and by none after a round that
    succeeds: a text the drafter guesses badly costs little more than not drafting. The tokens are the same either
    way; 0 drafts every round.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict = {}

    def __init__(self, model, generation_config: GenerationConfig, logits_processor=None) -> None:
        self.model = model
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.threshold = float(getattr(generation_config, "dspark_confidence_threshold", 0.0) or 0.0)
        min_accepted = getattr(generation_config, "dspark_min_accepted", None)
        self.min_accepted = 1.0 if min_accepted is None else float(min_accepted)
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0
        self.plain_steps = 0  # one-token steps taken instead of drafting (the back-off)
        self._pause = 0  # the current back-off's length
        self._skip = 0  # plain steps left before the next drafting round
        self._drafting = False  # whether the round being verified carries drafts

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict | None = None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0, **kwargs):
        self._drafting = False
        if is_first_iteration:  # the model's own prefill comes first; drafting needs its cache
            return input_ids, None
        if self._skip:  # the last drafts failed: a plain step (the same token) instead of a draft
            self._skip -= 1
            self.plain_steps += 1
            return input_ids, None
        self._drafting = True
        cache = model_kwargs["cache"]
        run = cache.generation_run
        graphs = run.graphs if run is not None else None  # cuda_graphs=True: the drafter replays from a graph
        next_ids = input_ids[:, -1]
        with torch.no_grad():
            if not self.do_sample:  # greedy drafts are the drafter's own argmax; the processors shape the verify
                draft = graphs.draft(next_ids) if graphs is not None else dspark_draft(self.model, next_ids, cache)
                draft_logits = draft.logits
            else:
                forward = graphs.draft_forward(next_ids) if graphs is not None else \
                    draft_forward(self.model, next_ids, cache)
                draft, draft_logits = self._sampled_drafts(input_ids, next_ids, *forward)
        count = verify_count(draft.confidence, self.threshold)
        self.drafted += count
        self.rounds += 1
        if count == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, draft.ids[:, 1:1 + count]], dim=1)
        return candidates, draft_logits[:, :count]

    def _sampled_drafts(self, input_ids: torch.Tensor, next_ids: torch.Tensor, hidden: torch.Tensor,
                        logits: torch.Tensor) -> tuple[Draft, torch.Tensor]:
        """Drafts sampled in order from the processed Markov-biased logits, and those processed logits (the draft
        distribution that speculative sampling needs to stay lossless)."""
        chosen, processed = [], []

        def choose(scores: torch.Tensor, index: int) -> torch.Tensor:
            context = torch.cat([input_ids] + [t.unsqueeze(1) for t in chosen], dim=1)
            if self.logits_processor is not None and len(self.logits_processor) > 0:
                scores = self.logits_processor(context, scores)  # choose_drafts hands a fresh tensor
            processed.append(scores)
            chosen.append(torch.multinomial(scores.softmax(dim=-1), 1).squeeze(1))
            return chosen[-1]

        draft = choose_drafts(self.model, next_ids, hidden, logits, choose)
        return draft, torch.stack(processed, dim=1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        if not self._drafting:
            return
        self.accepted += int(num_matches)
        if self.min_accepted > 0 and num_matches < self.min_accepted:
            self._pause = min(2 * self._pause or 1, BACKOFF_LIMIT)
            self._skip = self._pause
        else:
            self._pause = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification round: the accepted drafts plus the model's own token."""
        return 1.0 + self.accepted / max(self.rounds, 1)
