"""Training the DSpark drafter (`mtp.*`) against a frozen backbone, with the DSpark objective.

For a training sequence one backbone forward (no gradient) gives the DSpark taps and the backbone's next-token
distribution at every position. Many anchors are then drafted at once: for anchor position p the draft block is
[token p+1, noise x (block-1)] at positions p+1 .. p+block, each block attending to the window of taps at
positions <= p (the last `sliding_window` of them) and, without a causal mask, to itself. The Markov head and the
confidence head see the true previous tokens (teacher forcing). This reuses the model's own modules (the DSpark
blocks, their attention, the heads) on a batch of blocks, not the cache-based inference path.

Loss per drafted position k = 1 .. block (the token at p+1+k), weighted by exp(-(k-1)/block):
    0.1 x cross-entropy to the data token
  + 0.9 x L1 distance between the draft distribution and the backbone's distribution for the same token
  + 1.0 x binary cross-entropy of the confidence logit against 1 - L1/2 (the expected acceptance, no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import Trainer

from modeling_deepseek_v41.model.causal_lm import DeepseekV41ForCausalLM

TEXT = -1
DSPARK_LOSS_WEIGHTS = (0.1, 0.9, 1.0)  # cross-entropy, L1 distillation, confidence BCE


def _base(model):
    """The DeepseekV41ForCausalLM inside wrappers (PEFT, DDP)."""
    while not isinstance(model, DeepseekV41ForCausalLM):
        inner = getattr(model, "module", None) or getattr(model, "base_model", None) or getattr(model, "model", None)
        if inner is None or inner is model:
            raise TypeError(f"{type(model).__name__} holds no DeepseekV41ForCausalLM")
        model = inner
    return model


def freeze_all_but_drafter(model) -> list[str]:
    """Freeze the backbone (embedding and head included: the drafter shares them) and make every trainable
    parameter of `mtp.*` require gradients; the routing biases stay non-trainable. Returns the trainable names."""
    model = _base(model)
    model.requires_grad_(False)
    names = []
    for name, param in model.dspark.named_parameters():
        if name.endswith(("gate.bias", "gate.bias_vl")) or not param.is_floating_point() or param.element_size() < 2:
            continue
        param.requires_grad_(True)
        names.append(f"model.mtp.{name}")
    if not names:
        raise ValueError("The model has no trainable DSpark drafter parameters (no mtp.* or quantized weights: "
                         "call model.dequantize_weights() first).")
    return names


def backbone_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Positions as the model computes them without a cache: -1 at padding."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    mask = attention_mask.to(torch.bool)
    return torch.where(mask, mask.long().cumsum(-1) - 1, -1)


def draftable(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, token_types: torch.Tensor | None,
              pad_token_id: int | None = None) -> torch.Tensor:
    """[B,S] True where a position holds a real text token (drafts start at and predict text tokens only); fill
    positions are recognised by attention_mask 0 or by `pad_token_id`."""
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    if pad_token_id is not None:
        keep &= input_ids != pad_token_id
    if attention_mask is not None:
        keep &= attention_mask.to(torch.bool)
    if token_types is not None:
        keep &= token_types == TEXT
    return keep


def choose_anchors(text: torch.Tensor, num_anchors: int | None, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors p per row whose block start p+1 and first target p+2 are text. Returns indices [B,A] (sorted) and
    validity [B,A]; all candidates when num_anchors is None or larger, else a random subset of them."""
    batch, seq = text.shape
    ok = torch.zeros_like(text)
    ok[:, : seq - 2] = text[:, 1 : seq - 1] & text[:, 2:]
    counts = int(ok.sum(-1).amax()) if ok.numel() else 0
    take = counts if num_anchors is None else min(num_anchors, counts)
    take = max(take, 1)
    noise = torch.rand(ok.shape, generator=generator, device=ok.device) if num_anchors is not None else \
        torch.zeros(ok.shape, device=ok.device)
    # candidates first (random order when sampling), then keep the first `take` and sort them by position
    score = torch.where(ok, noise, 2.0) + torch.arange(seq, device=ok.device) * (1e-6 if num_anchors is None else 0)
    chosen = score.argsort(dim=-1, stable=True)[:, :take]
    chosen = chosen.sort(dim=-1).values
    return chosen, ok.gather(1, chosen)


@dataclass
class DraftBatch:
    logits: torch.Tensor  # [B,A,K,V] fp32 Markov-biased draft logits, block index i predicts the token at p+2+i
    confidence: torch.Tensor  # [B,A,K] raw confidence logits
    targets: torch.Tensor  # [B,A,K] data tokens at p+2 .. p+1+K
    teacher_index: torch.Tensor  # [B,A,K] sequence index of the backbone logits for the same token (p+1 .. p+K)
    mask: torch.Tensor  # [B,A,K] which drafted positions count


def dspark_training_logits(model, input_ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor,
                           anchor_valid: torch.Tensor, text: torch.Tensor,
                           attention_mask: torch.Tensor | None = None) -> DraftBatch:
    """Draft every anchor's block at once (teacher-forced), from the backbone taps [B,S,n_taps*D]."""
    model = _base(model)
    cfg = model.config.text_config
    size, window = cfg.dspark_block_size, cfg.sliding_window
    batch, seq = input_ids.shape
    n_anchors = anchors.shape[1]
    device = input_ids.device
    steps = torch.arange(size, device=device)
    positions = backbone_positions(input_ids, attention_mask)
    # block token indices p+1 .. p+K in the sequence, and the targets p+2 .. p+K+1
    block_index = anchors.unsqueeze(-1) + 1 + steps  # [B,A,K]
    in_range = block_index < seq
    block_index_c = block_index.clamp_max(seq - 1)
    prev_tokens = input_ids.gather(1, block_index_c.flatten(1)).view(batch, n_anchors, size)  # Markov inputs
    target_index = (block_index + 1).clamp_max(seq - 1)
    targets = input_ids.gather(1, target_index.flatten(1)).view(batch, n_anchors, size)
    target_ok = (block_index + 1 < seq) & text.gather(1, target_index.flatten(1)).view(batch, n_anchors, size)
    prev_ok = in_range & text.gather(1, block_index_c.flatten(1)).view(batch, n_anchors, size)
    # a drafted position counts while the block's own tokens and the target are all real text
    mask = (target_ok & prev_ok).long().cumprod(-1).bool() & anchor_valid.unsqueeze(-1)

    anchor_pos = positions.gather(1, anchors)  # [B,A]
    block_pos = anchor_pos.unsqueeze(-1) + 1 + steps
    drafter = model.dspark
    block_rotation = drafter.rotation(block_pos.flatten(0, 1))  # [N,K,rope/2]
    tap_rotation = drafter.rotation(positions.clamp_min(0))  # [B,S,rope/2]

    # each anchor's window: sequence indices p-W+1 .. p (padding positions are never inside it: right padding)
    width = min(window, seq)
    window_index = anchors.unsqueeze(-1) - (width - 1) + torch.arange(width, device=device)  # [B,A,W]
    window_valid = (window_index >= 0) & anchor_valid.unsqueeze(-1)
    window_index = window_index.clamp_min(0)

    main_x = drafter.project_taps(taps.to(drafter.tap_dtype))
    block_ids = torch.full_like(prev_tokens, cfg.dspark_noise_token_id)
    block_ids[..., 0] = prev_tokens[..., 0]
    flat_window = window_index.flatten(1)  # [B, A*W]

    def stage_window(stage, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each anchor's window of this stage's KV, projected from the taps at their positions."""
        kv = stage.window_kv(main_x, tap_rotation)  # [B,S,hd]
        window_kv = kv.gather(1, flat_window.unsqueeze(-1).expand(-1, -1, kv.shape[-1]))
        return window_kv.view(batch * n_anchors, width, kv.shape[-1]).to(dtype), window_valid.flatten(0, 1)

    hidden = drafter(model.get_input_embeddings()(block_ids.flatten(0, 1)), block_rotation, stage_window)
    base = drafter.logits(hidden, model.get_output_embeddings()).float()
    bias, embedding = drafter.markov(prev_tokens.flatten(0, 1))
    logits = base + bias.float()
    confidence = drafter.confidence(hidden, embedding)
    return DraftBatch(logits.view(batch, n_anchors, size, -1), confidence.view(batch, n_anchors, size).float(),
                      targets, block_index_c, mask)


def dspark_loss(draft: DraftBatch, teacher_logits: torch.Tensor, block_size: int,
                weights: tuple[float, float, float] = DSPARK_LOSS_WEIGHTS) -> tuple[torch.Tensor, dict]:
    """The DSpark objective on drafted positions (teacher_logits [B,S,V] of the frozen backbone).

    Returns the loss and detached metrics: each term, the expected acceptance 1 - L1/2 and the share of drafts
    whose argmax equals the backbone's argmax."""
    batch, n_anchors, size, vocab = draft.logits.shape
    teacher = teacher_logits.detach().float().gather(
        1, draft.teacher_index.flatten(1).unsqueeze(-1).expand(-1, -1, vocab)).view(batch, n_anchors, size, vocab)
    log_draft = draft.logits.log_softmax(-1)
    p_draft, p_teacher = log_draft.exp(), teacher.softmax(-1)
    ce = -log_draft.gather(-1, draft.targets.unsqueeze(-1)).squeeze(-1)
    l1 = (p_draft - p_teacher).abs().sum(-1)
    accept = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(draft.confidence, accept, reduction="none")
    k = torch.arange(size, device=l1.device, dtype=torch.float32)
    w = torch.exp(-k / block_size).view(1, 1, size) * draft.mask.float()
    norm = w.sum().clamp_min(1e-9)
    terms = {"ce": (w * ce).sum() / norm, "l1": (w * l1).sum() / norm, "conf_bce": (w * bce).sum() / norm}
    loss = weights[0] * terms["ce"] + weights[1] * terms["l1"] + weights[2] * terms["conf_bce"]
    m = draft.mask.float()
    count = m.sum().clamp_min(1.0)
    metrics = {name: float(value.detach()) for name, value in terms.items()}
    metrics["expected_accept"] = float((accept * m).sum() / count)
    metrics["argmax_agree"] = float(((draft.logits.argmax(-1) == teacher.argmax(-1)).float() * m).sum() / count)
    return loss, metrics


def drafter_step_loss(model, inputs: dict, num_anchors: int | None = 64, generator: torch.Generator | None = None,
                      weights: tuple[float, float, float] = DSPARK_LOSS_WEIGHTS, pad_token_id: int | None = None
                      ) -> tuple[torch.Tensor, dict]:
    """One batch: backbone forward without gradient, then the batched draft and its loss."""
    base = _base(model)
    batch = {key: value for key, value in inputs.items() if key != "labels"}
    with torch.no_grad():
        out = model(**batch)
    if out.dspark_hidden is None:
        raise ValueError("This model has no DSpark taps (dspark_target_layer_ids is empty).")
    input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
    text = draftable(input_ids, attention_mask, inputs.get("token_types"), pad_token_id)
    anchors, valid = choose_anchors(text, num_anchors, generator)
    draft = dspark_training_logits(base, input_ids, out.dspark_hidden.detach(), anchors, valid, text, attention_mask)
    return dspark_loss(draft, out.logits, base.config.text_config.dspark_block_size, weights)


class DSparkDrafterTrainer(Trainer):
    """A `Trainer` whose loss is the DSpark objective; use it on a model after `freeze_all_but_drafter(model)`
    (only `mtp.*` then gets gradients and optimizer state). `num_anchors` blocks are drafted per sequence (None:
    every text position); `dspark_loss_weights` = (cross-entropy, L1, confidence BCE)."""

    def __init__(self, *args, num_anchors: int | None = 64,
                 dspark_loss_weights: tuple[float, float, float] = DSPARK_LOSS_WEIGHTS, pad_token_id: int | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if pad_token_id is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None) or getattr(self, "processing_class", None)
            pad_token_id = getattr(getattr(tokenizer, "tokenizer", tokenizer), "pad_token_id", None)
        self.pad_token_id = pad_token_id
        self.num_anchors = num_anchors
        self.dspark_loss_weights = dspark_loss_weights
        self._anchor_generator = torch.Generator().manual_seed(self.args.seed)
        self._dspark_metrics: dict[str, list[float]] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, metrics = drafter_step_loss(model, inputs, self.num_anchors, self._anchor_generator,
                                          self.dspark_loss_weights, self.pad_token_id)
        for name, value in metrics.items():
            self._dspark_metrics.setdefault(name, []).append(value)
        return (loss, {"loss": loss}) if return_outputs else loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        for name, values in self._dspark_metrics.items():
            if values:
                logs[f"dspark_{name}"] = round(sum(values) / len(values), 4)
        self._dspark_metrics = {}
        super().log(logs, *args, **kwargs)


def expected_accepted_length(accept_rates: list[float]) -> float:
    """Tokens per verification if position k is accepted with probability accept_rates[k] given the earlier
    ones were: 1 (the backbone's own token) plus the sum of the prefix-survival products."""
    total, survive = 1.0, 1.0
    for rate in accept_rates:
        survive *= rate
        total += survive
    return total


__all__ = ["DSPARK_LOSS_WEIGHTS", "DSparkDrafterTrainer", "DraftBatch", "choose_anchors", "draftable",
           "drafter_step_loss", "dspark_loss", "dspark_training_logits", "expected_accepted_length",
           "freeze_all_but_drafter", "math"]
