"""GPU benchmark suite: prefill (exact vs bounded replay), decode step time against context length, and the
in-tree transformers DeepseekV4ForCausalLM at matched width and depth as the baseline, all in one process.

Run (on a CUDA machine): python benchmarks/gpu_suite.py [--contexts 1024 4096 16384 65536] [--quick]
Prints markdown tables; every number is a median of timed repetitions after warm-up, synchronised with CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402
from modeling_deepseek_v41.layers.engram_hashing import engram_table_rows  # noqa: E402

MEDIUM = dict(
    vocab_size=32000, hidden_size=2048, moe_intermediate_size=1024, num_hidden_layers=8, num_attention_heads=16,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=512, o_lora_rank=512, o_groups=4, sliding_window=128,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1, 0], kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 4, 6],
    index_n_heads=16, index_head_dim=128, index_topk=512, candidate_source_layer_id=4, candidate_topk_blocks=256,
    candidate_block_size=8, n_routed_experts=16, num_experts_per_tok=2, engram_layer_ids=[1],
    engram_vocab_size=20000, engram_n_heads=4, engram_head_dim=128, engram_compressed_vocab_size=30000,
    num_nextn_predict_layers=1, dspark_target_layer_ids=[5, 6, 7], dspark_n_routed_experts=8,
    dspark_num_experts_per_tok=2, dspark_noise_token_id=31999, dspark_markov_rank=64,
    max_position_embeddings=1 << 20,
)


def medium_config(quick: bool) -> DeepseekV41Config:
    text = dict(MEDIUM)
    if quick:  # a CPU smoke test of the script itself
        text.update(hidden_size=256, num_attention_heads=4, q_lora_rank=64, o_lora_rank=64, o_groups=2,
                    index_n_heads=4, n_routed_experts=4, vocab_size=2000, engram_compressed_vocab_size=1500,
                    dspark_noise_token_id=1999, candidate_topk_blocks=16, index_topk=64)
    from types import SimpleNamespace

    text["engram_num_embeddings"] = engram_table_rows(SimpleNamespace(
        engram_layer_ids=text["engram_layer_ids"], engram_max_ngram_size=4,
        engram_vocab_size=text["engram_vocab_size"], engram_n_heads=text["engram_n_heads"]))
    return DeepseekV41Config(text_config=text)


def build_model(config: DeepseekV41Config, device: str) -> DeepseekV41ForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV41ForCausalLM(config).eval()
    text = config.text_config
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
        model.model.engram_token_map.copy_(torch.arange(text.vocab_size, device=device) % text.engram_compressed_vocab_size)
    return model


def timed(fn, device: str, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall time of `fn` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def prefill_table(model, device: str, lengths: list[int]) -> list[dict]:
    vocab = model.config.text_config.vocab_size
    rows = []
    for length in lengths:
        ids = torch.randint(3, vocab, (1, length), device=device)
        result = {"tokens": length}
        for mode in ("exact", "bounded_replay"):
            def run(mode=mode):
                with torch.no_grad():
                    model(ids, cache=DeepseekV41Cache(model.config), prefill_mode=mode, logits_to_keep=1)
            result[mode] = timed(run, device, repeats=3, warmup=1)
        result["ratio"] = result["bounded_replay"] / result["exact"]
        rows.append(result)
        print(json.dumps(result), flush=True)
    return rows


def decode_table(model, device: str, contexts: list[int], chunk: int, steps: int = 12) -> list[dict]:
    vocab = model.config.text_config.vocab_size
    rows = []
    for context in contexts:
        cache = DeepseekV41Cache(model.config)
        ids = torch.randint(3, vocab, (1, context + steps + 4), device=device)
        with torch.no_grad():
            for start in range(0, context, chunk):
                model(ids[:, start:min(start + chunk, context)], cache=cache, logits_to_keep=1)
            position = [context]

            def step():
                model(ids[:, position[0]:position[0] + 1], cache=cache)
                position[0] += 1

            ms = timed(step, device, repeats=steps, warmup=2)
        if device == "cuda":
            memory = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        else:
            memory = float("nan")
        rows.append({"context": context, "decode_ms": ms, "tokens_per_s": 1e3 / ms,
                     "cache_global_bytes_per_token": cache.global_bytes_per_token(), "peak_gib": memory})
        print(json.dumps(rows[-1]), flush=True)
        del cache
    return rows


def intree_v4_decode(device: str, context: int, quick: bool) -> dict:
    """transformers' own DeepseekV4ForCausalLM at the medium model's width and depth."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    m = MEDIUM if not quick else {**MEDIUM, "hidden_size": 256, "num_attention_heads": 4, "q_lora_rank": 64,
                                  "o_lora_rank": 64, "o_groups": 2, "index_n_heads": 4, "n_routed_experts": 4,
                                  "vocab_size": 2000, "index_topk": 64}
    config = DeepseekV4Config(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], moe_intermediate_size=m["moe_intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"], num_attention_heads=m["num_attention_heads"],
        head_dim=m["head_dim"], q_lora_rank=m["q_lora_rank"], o_lora_rank=m["o_lora_rank"], o_groups=m["o_groups"],
        n_routed_experts=m["n_routed_experts"], num_experts_per_tok=m["num_experts_per_tok"],
        index_n_heads=m["index_n_heads"], index_head_dim=m["index_head_dim"], index_topk=m["index_topk"],
        sliding_window=m["sliding_window"], num_nextn_predict_layers=0,
    )
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, m["vocab_size"], (1, context + 20), device=device)
    with torch.no_grad():
        out = model(ids[:, :context], use_cache=True, logits_to_keep=1)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        position = [context]

        def step():
            nonlocal cache
            result = model(ids[:, position[0]:position[0] + 1], cache=cache, use_cache=True)
            cache = result.cache if hasattr(result, "cache") else result.past_key_values
            position[0] += 1

        ms = timed(step, device, repeats=12, warmup=2)
    return {"context": context, "decode_ms": ms, "tokens_per_s": 1e3 / ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-tree V4 baseline")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script on a CPU")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    config = medium_config(args.quick)
    model = build_model(config, device)
    if not args.no_baseline:
        print("== in-tree DeepseekV4ForCausalLM baseline", flush=True)
        try:
            print(json.dumps({"baseline": intree_v4_decode(device, min(args.contexts), args.quick)}), flush=True)
        except Exception as error:  # the baseline is reported, not required for the rest
            print(json.dumps({"baseline_error": f"{type(error).__name__}: {error}"}), flush=True)
    print("== prefill", flush=True)
    prefill_table(model, device, args.prefill)
    print("== decode", flush=True)
    decode_table(model, device, args.contexts, chunk=4096 if not args.quick else 256)
    print(json.dumps({"compile_counters": compile_counters()}), flush=True)


def compile_counters() -> dict:
    """What torch.compile did for the fused accelerator regions: graphs, recompilations, graph breaks."""
    from torch._dynamo.utils import counters

    return {group: dict(counters[group]) for group in ("stats", "recompiles", "graph_break") if counters[group]}


if __name__ == "__main__":
    main()
