"""A forward's inputs: their validation before any work (each problem a ValueError that names it and the fix), and
what the forward resolves from them first (the output flags, the token ids, the cache and the store, the
positions, the image spans and the dead positions).

Shape and dtype checks cost nothing. Checks that read tensor values (id range, all-masked rows, image spans) run
when the tensors are on the CPU or the forward processes more than one token; a one-token decode step on an
accelerator skips them, so it keeps running without a host sync (its id comes from the model's own logits).
"""

from __future__ import annotations

import torch

from ..cache.cache import DeepseekV41Cache
from ..cache.cache_store import CacheStore
from ..cache.chunk_store import ChunkStore
from ..config.config_validation import check_field
from ..kernels.dispatch import fast_path


def reads_values(input_ids: torch.Tensor) -> bool:
    """Whether checks that read tensor values run: never while tracing or recording a CUDA graph (a compiled,
    exported or replayed step cannot read them; the same step ran eagerly, checked, before it was recorded), and
    on an accelerator not for one-token steps (no host sync in decoding)."""
    if torch.compiler.is_compiling() or (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return not fast_path(input_ids) or input_ids.shape[1] > 1


def check_forward_inputs(config, input_ids, attention_mask=None, token_types=None, pixel_values=None, cache=None,
                         past_key_values=None) -> None:
    """Refuse inputs the forward cannot run correctly on. `cache` (or `past_key_values`) is the forward's cache."""
    cache = cache if cache is not None else past_key_values
    if input_ids is None:
        raise ValueError("input_ids is required here: the Engram hash is computed from token ids (inputs_embeds alone works only for a config without Engram layers).")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        kind = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an integer tensor of token ids, got {kind}; pass a LongTensor "
                         "(e.g. from the tokenizer with return_tensors='pt').")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, sequence], got {tuple(input_ids.shape)}; add the batch "
                         "dimension with input_ids.unsqueeze(0).")
    batch, seq = input_ids.shape
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); pass at least one token per row.")
    vocab = config.get_text_config().vocab_size
    reads = reads_values(input_ids)
    if reads:
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one reduction, one host read
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the vocabulary "
                             f"[0, {vocab - 1}]; check the tokenizer matches this checkpoint.")
    if attention_mask is not None:
        past = getattr(cache, "columns", 0)
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                             f"{tuple(input_ids.shape)}: the mask needs one row per input row ([{batch}, columns]).")
        if attention_mask.shape[1] not in (seq, past + seq):
            expected = f"{seq}" if past == 0 else f"{seq} (the new tokens) or {past + seq} (cache and new tokens)"
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} columns, but the input has {seq} "
                             f"tokens after {past} cached ones: pass a mask of {expected} columns.")
        if reads and attention_mask.shape[1] == past + seq and bool((attention_mask == 0).all(dim=1).any()):
            row = int((attention_mask == 0).all(dim=1).nonzero()[0])
            raise ValueError(f"attention_mask row {row} masks every token: a row needs at least one real token "
                             "(drop the row, or set its mask to 1 where it has tokens).")
    # generate() passes the prompt's token_types on to later steps; only those of this chunk are checked
    if token_types is not None and tuple(token_types.shape) == (batch, seq):
        if pixel_values is None and reads and bool((token_types >= 0).any()):
            raise ValueError("token_types marks an image span but no pixel_values were given; pass the processor's "
                             "pixel_values and image_grids, or token_types of -1 for text-only input.")


def check_generate_inputs(config, args: tuple, kwargs: dict) -> None:
    """generate()'s prompt, checked like a forward's input before transformers prepares anything (a prompt's mask
    covers exactly its ids, even with a restored cache)."""
    input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if input_ids is not None:  # without, transformers builds a prompt from the BOS token or reports the missing input
        check_forward_inputs(config, input_ids, kwargs.get("attention_mask"), kwargs.get("token_types"),
                             kwargs.get("pixel_values"))
    check_generate_cache(kwargs.get("cache", kwargs.get("past_key_values")), input_ids)


def prompt_rows(args: tuple, kwargs: dict) -> int:
    """The rows of generate()'s prompt (its ids or embeddings; 1 when transformers builds the prompt itself)."""
    for prompt in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs"),
                   kwargs.get("inputs_embeds")):
        if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2:
            return prompt.shape[0]
    return 1


def check_generate_cache(cache, input_ids: torch.Tensor | None) -> None:
    """A cache given to generate() is a DeepseekV41Cache, and the prompt extends the tokens it holds (the earlier
    turns' prompt and reply, then at least one new token)."""
    if cache is None:
        return
    if not isinstance(cache, DeepseekV41Cache):
        raise ValueError(
            f"generate() got a {type(cache).__name__} as its cache, but DeepSeek-V4.1 keeps compressed CSA2 pools, "
            "FP8 window rings and the Engram history that only a DeepseekV41Cache holds: pass "
            "DeepseekV41Cache(model.config) (from modeling_deepseek_v41.cache), or no cache (generate() creates one)."
        )
    cached = cache.get_seq_length()
    if not cached or input_ids is None:
        return
    if cache.batch_size != input_ids.shape[0]:
        raise ValueError(
            f"The cache holds {cache.batch_size} rows but the prompt has {input_ids.shape[0]}: a cache continues the "
            "rows it was filled with (one per prompt row; after beam search or num_return_sequences, one per beam or "
            "sequence). Pass the same rows, or a new cache."
        )
    if input_ids.shape[1] <= cached:
        raise ValueError(
            f"The prompt does not extend the cache: it has {input_ids.shape[1]} columns and the cache already holds "
            f"{cached}. A prompt given with a cache must be the cached tokens (the earlier prompt and reply) followed "
            "by at least one new token; pass the whole conversation so far plus the new turn, or a new cache."
        )
    if cache.pending_replay:  # a restored prefix: its own check names the saved prefix
        cache.check_extends(input_ids)
        return
    try:
        cache.check_extends(input_ids)
    except ValueError:
        raise ValueError(
            f"The prompt does not extend the cache: its first {cached} columns differ from the tokens the cache "
            "holds (the earlier prompt and reply). Pass the whole conversation so far, unchanged, plus the new "
            "turn, or a new cache."
        ) from None


def cache_in_use(use_cache: bool | None, default: bool, cache) -> bool:
    """Whether a forward keeps a cache: `use_cache`, or `default` when it is None. Under torch.export the cache is
    left out: an exported program is a function of tensors, and the cache is Python state that grows with every
    call (and links to its per-layer views), so a cache, or `use_cache=True`, is refused with the reason."""
    if not torch.compiler.is_exporting():
        return default if use_cache is None else use_cache
    if cache is not None or use_cache:
        raise ValueError("torch.export cannot take or return a DeepseekV41Cache: an exported program is a function "
                         "of tensors, and the cache is Python state that grows with every call. Export the forward "
                         "without a cache (use_cache=False, the default under export) and decode with the eager model.")
    return False


def output_flags(config, output_attentions, output_hidden_states, output_router_logits) -> tuple[bool, bool]:
    """(output_hidden_states, output_router_logits), each the config's when None; attention maps are refused."""
    if output_attentions or (output_attentions is None and config.output_attentions):
        raise ValueError("output_attentions=True is not supported: DeepSeek-V4.1's sparse attention (top-k "
                         "compressed blocks plus a sliding window) never materialises attention maps.")
    hidden = config.output_hidden_states if output_hidden_states is None else output_hidden_states
    router = config.text_config.output_router_logits if output_router_logits is None else output_router_logits
    return bool(hidden), bool(router)


def forward_ids(config, plan, training: bool, input_ids, inputs_embeds, cache, use_cache) -> tuple[torch.Tensor, bool]:
    """The token ids a forward runs on (zeros standing in for them with `inputs_embeds` alone, where nothing reads
    them) and whether it uses a cache (`use_cache=None` follows the config, and is off for a training forward that
    records gradients: the cache keeps packed FP4/FP8 bytes that carry none, and a recomputed checkpoint would find
    them written; never under torch.export: `cache_in_use`)."""
    if input_ids is not None:
        default = config.text_config.use_cache and not (training and torch.is_grad_enabled())
        return input_ids, cache_in_use(use_cache, default, cache)
    if inputs_embeds is None:
        raise ValueError("Pass input_ids (or inputs_embeds, for a config without Engram layers).")
    if plan.engram_layers:
        raise ValueError(
            f"inputs_embeds without input_ids is not supported by this config: its Engram layers "
            f"{list(plan.engram_layers)} hash the token ids. Pass input_ids (with inputs_embeds if wanted)."
        )
    if cache is not None or use_cache:
        raise ValueError("A cache records the token ids (for its restore and replay): pass input_ids with "
                         "inputs_embeds, or use_cache=False.")
    return torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device), False


def forward_store(config, cache, use_cache: bool, length: int, prefill_mode: str | None):
    """(the forward's cache or None, the store its layers use, the prefill mode) for a chunk of `length` tokens: a
    new cache when `use_cache` asks for one, a checked given one; the store is the cache's `CacheStore` for this
    forward, else a throw-away ChunkStore (one attention path with or without a cache); the chunk must fit the
    positions after the cached ones."""
    text = config.text_config
    if cache is None and use_cache:
        cache = DeepseekV41Cache(config)
    if cache is not None:
        if not isinstance(cache, DeepseekV41Cache):
            raise TypeError(f"DeepseekV41Model needs a DeepseekV41Cache, got {type(cache).__name__}.")
        cache.check_compatible(text)
    store = CacheStore(cache) if cache is not None else ChunkStore()  # without a cache, KV lives one forward
    past = store.get_seq_length()
    if past + length > text.max_position_embeddings:
        raise ValueError(
            f"Sequence of {past + length} tokens exceeds max_position_embeddings ({text.max_position_embeddings})."
        )
    if prefill_mode is not None:  # the config's own value was checked when the config was made
        check_field(text, "prefill_mode", prefill_mode)
    return cache, store, prefill_mode or text.prefill_mode


def token_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Positions [B,S] of a forward without a cache's own: counted over the mask's real tokens, -1 at padding."""
    batch, seq = input_ids.shape
    if attention_mask is None:
        return torch.arange(seq, device=input_ids.device).expand(batch, seq)
    mask = attention_mask[:, -seq:].to(torch.bool)
    return torch.where(mask, mask.long().cumsum(-1) - 1, -1)


def dead_positions(positions: torch.Tensor, token_types: torch.Tensor | None, keep_padding: bool
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(image mask, dead mask) [B,S]: image spans, and image spans or padding (no Engram n-gram, no live gate).
    Without `keep_padding` an all-False padding mask is dropped (one host read), so a forward without padding
    skips the masking."""
    padding = positions < 0
    padding = padding if keep_padding or bool(padding.any()) else None
    image_mask = token_types >= 0 if token_types is not None else None
    dead = image_mask
    if padding is not None:
        dead = padding if dead is None else dead | padding
    return image_mask, dead
