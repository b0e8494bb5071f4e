"""What a saved prefix cache depends on, recorded so that restoring it into anything else is refused.

Three parts, compared separately on restore so the error names what differs:
- `weights_digest`: the parameters that produce the stored KV (embedding, vision tower, every layer up to the last
  pool or index-key writer; not the output head, final norm or drafter), hashed on the device they live on;
- `token_map_digest`: the Engram token map (another tokenizer gives another compressed history);
- `cache_config`: the config fields that shape the cache and the attention that reads it.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache

import torch

from ..kernels.byte_sums import weighted_byte_sums

HASH_CHUNK = 1 << 14  # bytes per weighted sum: 255 * 2**20 * 2**14 < 2**53, so every float64 sum is exact
_COEFFICIENT_RANGE = 2**20

# the fields that shape the cache's tensors: a cache must agree on them with the model that uses it
CACHE_SHAPE_FIELDS = ("hidden_size", "head_dim", "num_hidden_layers", "compress_ratios", "kv_source_layer_ids",
                      "index_source_layer_ids", "sliding_window", "index_head_dim", "engram_layer_ids", "vocab_size")
# every text-config field that changes what the pools hold or how attention reads them
CACHE_CONFIG_FIELDS = CACHE_SHAPE_FIELDS + (
    "num_attention_heads", "num_key_value_heads", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
    "hidden_act", "swiglu_limit", "rms_norm_eps",
    "max_position_embeddings", "rope_theta", "rope_parameters", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "scoring_func", "topk_method", "norm_topk_prob", "routed_scaling_factor",
    "moe_intermediate_size", "compress_rope_theta", "index_n_heads", "index_topk", "candidate_source_layer_id",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_token_id", "engram_compressed_vocab_size",
)


def cache_signature(text_config) -> tuple:
    """What a cache must agree on with the model that uses it (its shape fields, as strings)."""
    return tuple((k, str(getattr(text_config, k))) for k in CACHE_SHAPE_FIELDS)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_NOT_FEEDING_THE_POOLS = re.compile(r"^(?:model\.)?(?:norm|head|lm_head|mtp|dspark)(?:\.|$)")


@lru_cache(maxsize=None)
def _coefficients(device: torch.device) -> torch.Tensor:
    """Distinct non-zero per-byte weights, so any single changed byte changes its chunk's sum."""
    index = torch.arange(1, HASH_CHUNK + 1, dtype=torch.int64)
    return ((index * 2654435761) % (_COEFFICIENT_RANGE - 1) + 1).to(device, torch.int32)


def kv_producing_parameters(model) -> list[tuple[str, torch.Tensor]]:
    """The parameters whose values reach the stored pools, index keys and carries."""
    text = model.config.get_text_config()
    last_writer = max([*text.kv_source_layer_ids, *text.index_source_layer_ids])
    chosen = []
    for name, parameter in model.named_parameters():
        layer = _LAYER_INDEX.search(name)
        if (layer is not None and int(layer.group(1)) > last_writer) or (
                layer is None and _NOT_FEEDING_THE_POOLS.match(name)):
            continue
        chosen.append((name, parameter))
    return chosen


def weights_digest(model, method: str | None = None) -> str:
    """A digest of `kv_producing_parameters` in which every byte counts, as "method:hex". "sha256" hashes the bytes
    on the host (the fast way on CPU); "chunk-sums" hashes per-chunk weighted byte sums computed on each tensor's
    device (the fast way on accelerators: one device-to-host copy of 1/2048 of the bytes per device). Saving picks
    by where the weights are; restoring recomputes with the saved method, so both placements compare."""
    parameters = kv_producing_parameters(model)
    if method is None:
        method = "sha256" if all(p.device.type in ("cpu", "meta") for _, p in parameters) else "chunk-sums"
    if method not in ("sha256", "chunk-sums"):
        return f"{method}:unknown"
    digest = hashlib.sha256()
    present = [(name, p) for name, p in parameters if p.device.type != "meta"]
    for name, parameter in parameters:
        digest.update(f"{name}|{tuple(parameter.shape)}|{parameter.dtype};".encode())
    if method == "sha256":
        for _, parameter in present:
            digest.update(memoryview(parameter.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        return f"sha256:{digest.hexdigest()}"
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, parameter in present:
        by_device.setdefault(parameter.device, []).append(
            parameter if parameter.is_contiguous() else parameter.contiguous())
    # per tensor: its whole chunks' sums and the remainder's (see kernels.byte_sums), one call per device
    sums = {device: weighted_byte_sums(tensors, _coefficients(device)).cpu() for device, tensors in by_device.items()}
    if len(sums) > 1:
        counts = {device: [t.numel() * t.element_size() // HASH_CHUNK + 1 for t in tensors]
                  for device, tensors in by_device.items()}
        sums = {None: in_name_order([parameter.device for _, parameter in present], counts, sums)}
    for ordered in sums.values():
        digest.update(memoryview(ordered.numpy()))
    return f"chunk-sums:{digest.hexdigest()}"


def in_name_order(devices: list, counts: dict, sums: dict) -> torch.Tensor:
    """Per-device sums (each device's parameters' sums concatenated, counts[device] of them per parameter) in the
    parameters' name order, devices[i] being the i-th parameter's: the digest whatever the placement."""
    pieces = {device: iter(sums[device].split(counts[device])) for device in sums}
    return torch.cat([next(pieces[device]) for device in devices])


def token_map_digest(model) -> str:
    token_map = getattr(model.base_model, "engram_token_map", None)
    if token_map is None:
        return "none"
    return hashlib.sha256(token_map.detach().to("cpu", torch.int64).numpy().tobytes()).hexdigest()


def cache_config(model) -> dict[str, str]:
    text = model.config.get_text_config()
    fields = {name: json.dumps(getattr(text, name, None), sort_keys=True, default=str) for name in CACHE_CONFIG_FIELDS}
    fields["image_token_id"] = json.dumps(getattr(model.config, "image_token_id", None))
    fields["weight_mode"] = json.dumps(getattr(model.config, "weight_mode", None))
    return fields


def fingerprint(model) -> dict[str, str]:
    """The header fields a saved cache stores and a restore compares."""
    return {"weights_digest": weights_digest(model), "token_map_digest": token_map_digest(model),
            "cache_config": json.dumps(cache_config(model), sort_keys=True)}


def fingerprint_mismatch(saved: dict[str, str], model) -> str | None:
    """What differs between a saved cache's fingerprint and `model`, in words; None when nothing does."""
    try:
        saved_config = json.loads(saved.get("cache_config", "{}"))
    except json.JSONDecodeError:
        return "its config record is unreadable"
    current_config = cache_config(model)
    changed = [f"{name} (saved {saved_config.get(name)}, this model {value})"
               for name, value in current_config.items() if saved_config.get(name) != value]
    if changed:
        return "the config differs: " + "; ".join(changed)
    if saved.get("token_map_digest") != token_map_digest(model):
        return "the Engram token map differs (another tokenizer?)"
    saved_weights = saved.get("weights_digest", "")
    if saved_weights != weights_digest(model, method=saved_weights.partition(":")[0]):
        return ("the weights that produce the stored KV differ (a fine-tune or another checkpoint: embedding, vision "
                "tower or layers up to the last pool writer)")
    return None
