"""Memory plan of a configuration, computed on the meta device: bytes per component as the model holds them,
the cache per sequence at a given context (the cache's own storage rules), and what each GPU holds under tensor
parallelism and under the CSA2-aware device map.

    python -m modeling_deepseek_v41.tools.memory_plan [config.json]     # the released configuration by default
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from ..cache.packed_rows import PackedRows
from ..config.configuration_deepseek_v41 import DeepseekV41Config
from ..loading.device_map import deepseek_device_map, key_bytes
from ..loading.parameter_count import component_of, count_parameters
from ..model.causal_lm import DeepseekV41ForCausalLM

GB = 10**9
GIB = 2**30
CROP_HORIZON = 64  # the cache's default: window rings hold sliding_window + this many slots
ENGRAM_HISTORY_BYTES = 9  # per token: the compressed id (int64) and the real-token flag, as the cache counts them
# parameters split across ranks by DeepseekV41Config.base_model_tp_plan (everything else is replicated)
TP_SPLIT = re.compile(r"(\.ffn\.experts\.|\.attn\.(wq_b|wo_a)\.|\.attn\.attn_sink$|engram\.embed\.|^(lm_)?head\.)")
GPUS = {"8x H200 (141 GB)": 141 * GB, "8x H100 (80 GB)": 80 * GB}


def build_meta_model(config: DeepseekV41Config):
    with torch.device("meta"):
        return DeepseekV41ForCausalLM(config)


def component_bytes(model) -> dict[str, int]:
    """Bytes each component holds in memory (quantized bytes and their scales, dense weights at their dtype)."""
    totals: dict[str, int] = {}
    for name, tensor in model.state_dict().items():
        group = component_of(name)
        totals[group] = totals.get(group, 0) + tensor.nbytes
    return totals


def cache_bytes(text_config, tokens: int, drafting: bool = True) -> dict[str, int]:
    """One sequence's cache at `tokens` of context: compressed pools and index keys (global), the fixed window
    rings of every layer (and drafter stage), and the Engram token history."""
    global_per_token = 0.0
    ratios = text_config.compress_ratios
    for layer in text_config.kv_source_layer_ids:
        row = (PackedRows("fp4_e4m3", 1, text_config.head_dim, 1, "meta").bytes_per_row
               + PackedRows("fp4_e8m0", 1, text_config.index_head_dim, 1, "meta").bytes_per_row)
        global_per_token += row / ratios[layer]
    layers = text_config.num_hidden_layers + (text_config.num_nextn_predict_layers if drafting else 0)
    slot = PackedRows("fp8_e8m0", 1, text_config.head_dim, 1, "meta").bytes_per_row
    window = layers * (text_config.sliding_window + CROP_HORIZON) * slot
    return {"global_per_token": global_per_token, "global": int(global_per_token * tokens), "window": window,
            "engram_history": ENGRAM_HISTORY_BYTES * tokens}


def tensor_parallel_bytes(model, ranks: int) -> int:
    """What one rank holds under the tensor-parallel plan."""
    total = 0
    for name, tensor in model.state_dict().items():
        total += -(-tensor.nbytes // ranks) if TP_SPLIT.search(name) else tensor.nbytes
    return total


def memory_plan(config: DeepseekV41Config, contexts: tuple[int, ...] = (131072, 1048576)) -> dict:
    model = build_meta_model(config)
    components = component_bytes(model)
    counts = count_parameters(model)
    tables = components.get("engram_tables", 0)
    total = sum(components.values())
    caches = {tokens: cache_bytes(config.text_config, tokens) for tokens in contexts}
    tp = tensor_parallel_bytes(model, 8)
    return {"components": components, "parameters": counts, "total_bytes": total, "engram_table_bytes": tables,
            "cache": caches, "tp8_per_rank": tp, "tp8_per_rank_tables_off_device": tp - -(-tables // 8),
            "model": model}


def _fit_lines(plan: dict) -> list[str]:
    lines = ["", "| GPUs | placement | Engram tables | per GPU (GB) | room left for caches (GB) | 1M-token sequences |",
             "|---|---|---|---|---|---|"]
    model = plan["model"]
    per_sequence = {t: sum(v for k, v in c.items() if k != "global_per_token") for t, c in plan["cache"].items()}
    million = per_sequence[max(per_sequence)]
    for label, capacity in GPUS.items():
        for tables, per_rank in (("on GPUs", plan["tp8_per_rank"]), ("host/mmap", plan["tp8_per_rank_tables_off_device"])):
            room = capacity - per_rank - 0.1 * capacity  # a tenth kept for activations
            fits = f"{max(0, int(room // million))}" if room > 0 else "does not fit"
            lines.append(f"| {label} | tp_plan=\"auto\" (8 ranks; the cache is replicated) | {tables} | "
                         f"{per_rank / GB:.1f} | {room / GB:.1f} | {fits} |")
        for tables in ("on GPUs", "host/mmap"):
            skeleton = model if tables == "on GPUs" else plan.setdefault("model_off", _off_device_model(model))
            device_map = deepseek_device_map(skeleton, dict.fromkeys(range(8), capacity))
            modules = dict(skeleton.named_modules())
            per_device: dict = {}
            for key, device in device_map.items():
                per_device[device] = per_device.get(device, 0) + key_bytes(skeleton, modules, key)
            offloaded = sum(v for d, v in per_device.items() if d in ("cpu", "disk"))
            main = per_device.get(0, 0)
            room = capacity - main - 0.1 * capacity
            gpus = [per_device.get(i, 0) / GB for i in range(8)]
            note = f"; {offloaded / GB:.0f} GB offloaded to disk" if offloaded else ""
            lines.append(f"| {label} | device_map=\"auto\" (cache on GPU 0) | {tables} | "
                         f"{min(gpus):.0f}-{max(gpus):.0f}{note} | {room / GB:.1f} (GPU 0) | "
                         f"{max(0, int(room // million))} |")
    return lines


def _off_device_model(model):
    import copy

    config = copy.deepcopy(model.config)
    config.engram_storage = "mmap"
    return build_meta_model(config)


def format_plan(plan: dict) -> str:
    """The plan as markdown tables (what docs/multi_gpu.md shows)."""
    lines = ["| component | parameters (B) | bytes in memory (GB) |", "|---|---|---|"]
    for group, nbytes in sorted(plan["components"].items(), key=lambda item: -item[1]):
        lines.append(f"| {group} | {plan['parameters'].get(group, 0) / 1e9:.2f} | {nbytes / GB:.2f} |")
    off = plan["total_bytes"] - plan["engram_table_bytes"]
    lines.append(f"| **total** | {plan['parameters']['total'] / 1e9:.1f} | {plan['total_bytes'] / GB:.1f} "
                 f"({off / GB:.1f} without the Engram tables) |")
    lines += ["", "| context | global KV (GB) | window rings (MB) | Engram history (MB) | per sequence (GB) |",
              "|---|---|---|---|---|"]
    for tokens, cache in plan["cache"].items():
        total = cache["global"] + cache["window"] + cache["engram_history"]
        lines.append(f"| {tokens:,} | {cache['global'] / GB:.3f} ({cache['global_per_token']:.0f} B/token) | "
                     f"{cache['window'] / 1e6:.1f} | {cache['engram_history'] / 1e6:.1f} | {total / GB:.3f} |")
    return "\n".join(lines + _fit_lines(plan))


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "tests/fixtures/spec/official_config.json"
    print(format_plan(memory_plan(DeepseekV41Config(**json.loads(path.read_text())))))


if __name__ == "__main__":
    main(sys.argv[1:])
