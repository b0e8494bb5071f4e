"""The released widths on one GPU: decode and prefill of DeepSeek-V4.1-Flash as shipped (quantized) or in bf16.

The model is built in memory as `DeepseekV41ForCausalLM(config)` from the hub config (`spec/official_config.json`
layout: hidden 5120, 64 x 512 heads, 40 layers with the real CSA2 schedule, DSpark, vocab 129,280). Only the
routed experts (`--experts`, default 32 per layer) and the Engram tables (`--engram-rows` per table) are cut so it
fits one GPU; batch-1 decode reads `num_experts_per_tok` experts per layer whatever their count.

Every decode row is printed beside its HBM roofline: the bytes the step must read (every weight except the
embedding table, the Engram tables and the drafter, in its stored precision; of the routed experts only those
the step's tokens can select, min(E, B*k) per layer) over `--bandwidth` (H200: 4.8 TB/s).

Run (one weight mode per process; the bf16 mode needs about 3.5x the memory):
    python benchmarks/realwidth.py --mode quantized
    python benchmarks/realwidth.py --mode bf16 --skip-prefill 65536
    python benchmarks/realwidth.py --batches --no-dspark --prefill --agent-turn 65536 1024   # an agent's next turn
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loading import drop_cached  # noqa: E402
from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402
from modeling_deepseek_v41.cache.fingerprint import fingerprint_mismatch  # noqa: E402
from modeling_deepseek_v41.cache.persistence import content_checksum, read_saved  # noqa: E402
from modeling_deepseek_v41.layers.engram_hashing import engram_table_rows  # noqa: E402
from modeling_deepseek_v41.model.generation import DeepseekV41CUDAGraphDecoder  # noqa: E402
from modeling_deepseek_v41.model.generation.dspark import dspark_draft  # noqa: E402

OFFICIAL = ROOT / "tests" / "fixtures" / "spec" / "official_config.json"


def released_config(mode: str, experts: int, engram_rows: int) -> DeepseekV41Config:
    """The hub config with the routed experts and Engram tables cut to fit one GPU, text only."""
    raw = json.loads(OFFICIAL.read_text())
    text = dict(raw["text_config"])
    text["n_routed_experts"] = experts
    text["dspark_n_routed_experts"] = min(text["dspark_n_routed_experts"], experts)
    # each n-gram head's table is a prime number of rows near vocab/heads; scale the vocabulary to the row count
    scale = engram_rows / sum(text["engram_num_embeddings"]) * len(text["engram_num_embeddings"])
    text["engram_vocab_size"] = max(1, int(text["engram_vocab_size"] * scale))
    text["engram_num_embeddings"] = engram_table_rows(SimpleNamespace(**text))
    quantization = raw["quantization_config"] if mode == "quantized" else None
    return DeepseekV41Config(text_config=text, quantization_config=quantization,
                             weight_mode="quantized" if mode == "quantized" else "bf16")


def build(config: DeepseekV41Config) -> DeepseekV41ForCausalLM:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DeepseekV41ForCausalLM(config).eval()
    text = config.text_config
    with torch.no_grad():
        if hasattr(model.model, "engram_token_map"):
            model.model.engram_token_map.copy_(torch.arange(text.vocab_size, device="cuda")
                                         % text.engram_compressed_vocab_size)
    return model


def step_bytes(model: DeepseekV41ForCausalLM, batch: int, experts_read: float | None = None) -> int:
    """Bytes of stored weights a decode step of `batch` rows reads (see the module docstring); `experts_read`
    replaces min(E, batch * k) routed experts per layer (the tokens of one row share it, see expected_experts)."""
    text = model.config.text_config
    if experts_read is None:
        experts_read = min(text.n_routed_experts, batch * text.num_experts_per_tok)
    total = 0
    for name, param in model.named_parameters():
        name = name.removeprefix("model.")  # the base model's names are the hub's
        if name.startswith(("embed.", "mtp.", "vision.", "aligner.")) or ".engram.embed." in name:
            continue
        size = param.numel() * param.element_size()
        if ".ffn.experts." in name:
            size = size * experts_read / text.n_routed_experts
        total += size
    return int(total)


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct routed experts `tokens` tokens read per layer on average if each picks top_k of them uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def timed_ms(fn, repeats: int, warmup: int = 2, after=None) -> float:
    """Median CUDA-event time of `fn` in milliseconds (`after`, untimed, runs after each call)."""
    for _ in range(warmup):
        fn()
        if after is not None:
            after()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if after is not None:
            after()
    return statistics.median(times)


def prefilled_cache(model, context: int, batch: int, chunk: int = 8192, dspark: bool = False
                    ) -> tuple[DeepseekV41Cache, torch.Tensor]:
    """A cache holding `context` random tokens, prefilled once and repeated to `batch` rows."""
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(3, vocab, (1, context), device="cuda")
    cache = DeepseekV41Cache(model.config, dspark=dspark)
    with torch.no_grad():
        for start in range(0, context, chunk):
            model(ids[:, start:start + chunk], cache=cache, logits_to_keep=1, prefill_mode="bounded_replay")
    if batch > 1:
        cache.batch_repeat_interleave(batch)
    return cache, torch.randint(3, vocab, (batch, 1), device="cuda")


def decode_rows(model, context: int, batches: list[int], steps: int, bandwidth: float, eager: bool) -> list[dict]:
    rows = []
    for batch in batches:
        cache, token = prefilled_cache(model, context, batch)
        row = {"decode_batch": batch, "context": context}
        if eager and batch == 1:  # eager rows beyond batch 1 cost minutes and are not a target
            eager_cache = copy.deepcopy(cache)

            def eager_step():
                with torch.no_grad():
                    model(token, cache=eager_cache)
            row["eager_ms"] = timed_ms(eager_step, repeats=max(3, steps // 4), warmup=1)
            del eager_cache
        decoder = DeepseekV41CUDAGraphDecoder(model, cache, max_new_tokens=steps + 8)
        row["graph_ms"] = timed_ms(lambda: decoder.step(token), repeats=steps, warmup=3)
        decoder.close()
        row["tokens_per_s"] = batch * 1e3 / row["graph_ms"]
        row["roofline_ms"] = step_bytes(model, batch) / bandwidth * 1e3
        row["x_roofline"] = row["graph_ms"] / row["roofline_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del cache, decoder
        torch.cuda.empty_cache()
    return rows


def dspark_rows(model, context: int, steps: int, accepted_lengths=(2.8, 3.5)) -> dict:
    """Batch 1 with the drafter's rings: a replayed one-token step, a replayed verify step of the token and its
    drafts (block + 1 tokens; cropped back, untimed, after each), a replayed drafter forward; and the time per
    output token a drafting round would take at the given mean accepted lengths (the checkpoint's drafter is
    random at these widths, so its own acceptance means nothing)."""
    block = model.config.text_config.dspark_block_size
    cache, token = prefilled_cache(model, context, 1, dspark=True)
    decoder = DeepseekV41CUDAGraphDecoder(model, cache, max_new_tokens=steps + 2 * block + 8, widest=block + 1)
    verify = torch.randint(3, model.config.text_config.vocab_size, (1, block + 1), device="cuda")
    row = {"dspark_context": context, "step_ms": timed_ms(lambda: decoder.step(token), repeats=steps, warmup=3)}
    row["verify_ms"] = timed_ms(lambda: decoder.step(verify), repeats=steps, warmup=3,
                                after=lambda: cache.crop(-(block + 1)))
    row["draft_ms"] = timed_ms(lambda: decoder.call("draft", lambda ids: dspark_draft(model, ids, cache), token[:, 0]),
                               repeats=steps, warmup=3)
    decoder.close()
    row["verify_over_step"] = row["verify_ms"] / row["step_ms"]
    text = model.config.text_config  # a verify's tokens share experts: its roofline over the step's
    read = expected_experts(text.n_routed_experts, text.num_experts_per_tok, block + 1)
    row["verify_roofline_over_step_roofline"] = step_bytes(model, 1, read) / step_bytes(model, 1)
    row["draft_over_step"] = row["draft_ms"] / row["step_ms"]
    for length in accepted_lengths:
        per_token = (row["draft_ms"] + row["verify_ms"]) / length
        row[f"ms_per_token_at_{length}"] = per_token
        row[f"speedup_at_{length}"] = row["step_ms"] / per_token
    print(json.dumps(row), flush=True)
    del cache
    torch.cuda.empty_cache()
    return row


def profile_decode(model, context: int, steps: int = 3, top: int = 50, width: int = 1, draft: bool = False,
                   batch: int = 1) -> None:
    """The CUDA time of a graph-replayed decode step of `batch` rows of `width` tokens by kernel (torch.profiler),
    largest first; width > 1 is DSpark's verify step (batch 1, on a cache with the drafter's rings, cropped back
    after each), `draft` the drafter's replayed forward instead."""
    rings = width > 1 or draft
    cache, token = prefilled_cache(model, context, batch, dspark=rings)
    block = model.config.text_config.dspark_block_size
    decoder = DeepseekV41CUDAGraphDecoder(model, cache, max_new_tokens=steps + width + block + 8,
                                          widest=block + 1 if draft else width)
    ids = torch.randint(3, model.config.text_config.vocab_size, (1, width), device="cuda") if width > 1 else token

    def step():
        if draft:
            decoder.call("draft", lambda next_ids: dspark_draft(model, next_ids, cache), token[:, 0])
            return
        decoder.step(ids)
        if width > 1:
            cache.crop(-width)
    for _ in range(3):  # eager, recording, one replay
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    decoder.close()
    kernels = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                     key=lambda e: -e.self_device_time_total)
    what = "drafter forward" if draft else f"{width}-token step" + (f" of {batch} rows" if batch > 1 else "")
    print(f"top kernels of a replayed {what} (us per call, launches per call):")
    for e in kernels[:top]:
        print(f"K {e.self_device_time_total / steps:10.1f} {e.count // steps:6d}  {e.key[:100]}")
    total = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    launches = sum(e.count for e in kernels) // steps
    print(json.dumps({"profiled": what, "profiled_steps": steps, "gpu_busy_ms_per_step": total,
                      "launches_per_step": launches}), flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profiled(run, what: str, top: int) -> dict:
    """One call of `run` under torch.profiler (CPU and CUDA, with stacks): its kernels and the package's launching
    source lines by GPU time, largest first; returns its GPU time, launches and host synchronizations."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        run()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA"),
                     key=lambda e: -e.self_device_time_total)
    print(f"top kernels of {what} (ms, launches):")
    for e in kernels[:top]:
        print(f"P {e.self_device_time_total / 1e3:9.1f} {e.count:7d}  {e.key[:100]}")
    ops = sorted((e for e in prof.key_averages(group_by_stack_n=6) if e.self_device_time_total > 0
                  and e.device_type.name == "CPU"), key=lambda e: -e.self_device_time_total)
    print("top launching ops by source (ms of their kernels, calls):")
    for e in ops[:top]:
        frames = [f for f in e.stack if "modeling_deepseek_v41" in f][:3]
        print(f"S {e.self_device_time_total / 1e3:9.1f} {e.count:7d}  {e.key[:40]}  " + " < ".join(
            f.split("modeling_deepseek_v41/")[-1] for f in frames))
    return {"gpu_busy_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
            "launches": sum(e.count for e in kernels),
            "host_synchronizations": sum(e.count for e in events if e.key == "cudaStreamSynchronize")}


def profile_prefill(model, length: int, mode: str, top: int = 40) -> None:
    """The CUDA time of one prefill call of `length` tokens (after a warm-up call) by kernel and by launching line."""
    ids = torch.randint(3, model.config.text_config.vocab_size, (1, length), device="cuda")

    def run():
        with torch.no_grad():
            model(ids, cache=DeepseekV41Cache(model.config), prefill_mode=mode, logits_to_keep=1)
    run()
    torch.cuda.synchronize()
    stats = profiled(run, f"a {length}-token {mode} prefill", top)
    print(json.dumps({"profiled_prefill": length, "mode": mode, **stats}), flush=True)


def agent_turn(model, prefix: int, new: int, folder: Path, mode: str = "bounded_replay", profile: bool = False
               ) -> dict:
    """An agent's next turn: `prefix` tokens saved as a persistent prefix cache, then the time to the first token of
    `new` more tokens from the file (dropped from the page cache first: the read is the disk's; restoring includes
    the file's checksum and the weights digest it is checked against) against a cold prefill of all prefix + new
    tokens, both in `mode`. Medians of 2 after a warm-up; the restored turn also split into restore and forward,
    whose kernels and host synchronizations `profile` prints."""
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(3, vocab, (1, prefix + new), device=model.device)
    folder = Path(tempfile.mkdtemp(dir=folder))
    path = folder / "agent-prefix.cache"
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        for start in range(0, prefix, 8192):
            model(ids[:, start:min(start + 8192, prefix)], cache=cache, logits_to_keep=1, prefill_mode=mode)
        cache.save(path, model)
    del cache

    def restored_turn():
        drop_cached(folder)  # the next read is the disk's
        synchronize(model.device)
        begin = time.perf_counter()
        with torch.no_grad():
            restored = DeepseekV41Cache.load(path, model)
            synchronize(model.device)
            loaded = time.perf_counter()
            model(ids[:, prefix:], cache=restored, logits_to_keep=1, prefill_mode=mode).logits.argmax(-1).tolist()
        end = time.perf_counter()
        return end - begin, loaded - begin, end - loaded

    def cold_turn():
        synchronize(model.device)
        begin = time.perf_counter()
        with torch.no_grad():
            model(ids, cache=DeepseekV41Cache(model.config), logits_to_keep=1,
                  prefill_mode=mode).logits.argmax(-1).tolist()
        return (time.perf_counter() - begin,)
    row = {"agent_turn_prefix": prefix, "new_tokens": new, "mode": mode, "file_gb": path.stat().st_size / 1e9}
    for name, turn, parts in (("restored_first_token_s", restored_turn, ("restore_s", "forward_s")),
                              ("cold_first_token_s", cold_turn, ())):
        turn()
        times = [turn() for _ in range(2)]
        for i, key in enumerate((name, *parts)):
            row[key] = statistics.median(t[i] for t in times)
    row["cold_over_restored"] = row["cold_first_token_s"] / row["restored_first_token_s"]
    if profile:
        row.update(restore_parts(model, path))
        with torch.no_grad():
            restored = DeepseekV41Cache.load(path, model)
            stats = profiled(lambda: model(ids[:, prefix:], cache=restored, logits_to_keep=1, prefill_mode=mode),
                             "the restored turn's forward", 30)
        row.update({f"forward_{key}": value for key, value in stats.items()})
    shutil.rmtree(folder)
    print(json.dumps(row), flush=True)
    return row


def restore_parts(model, path: Path) -> dict:
    """Seconds of each part of restoring `path`, timed alone: reading it from the disk (dropped from the page cache
    first), its sha256 checksum, the fingerprint check (the weights digest on the device), its tensors to the
    device. Medians of 2."""
    parts = {"restore_read_s": [], "restore_checksum_s": [], "restore_fingerprint_s": [], "restore_to_device_s": []}
    for _ in range(2):
        drop_cached(path.parent)
        begin = time.perf_counter()
        metadata, tensors = read_saved(path)
        parts["restore_read_s"].append(time.perf_counter() - begin)
        begin = time.perf_counter()
        content_checksum(metadata, tensors)
        parts["restore_checksum_s"].append(time.perf_counter() - begin)
        begin = time.perf_counter()
        assert fingerprint_mismatch(metadata, model) is None
        synchronize(model.device)
        parts["restore_fingerprint_s"].append(time.perf_counter() - begin)
        begin = time.perf_counter()
        for tensor in tensors.values():
            tensor.to(model.device)
        synchronize(model.device)
        parts["restore_to_device_s"].append(time.perf_counter() - begin)
    return {key: statistics.median(times) for key, times in parts.items()}


def prefill_rows(model, lengths: list[int], modes: list[str], skip: set[tuple[str, int]]) -> list[dict]:
    vocab = model.config.text_config.vocab_size
    rows = []
    for length in lengths:
        for mode in modes:
            if (mode, length) in skip:
                continue
            ids = torch.randint(3, vocab, (1, length), device="cuda")
            torch.cuda.reset_peak_memory_stats()

            def run():
                with torch.no_grad():
                    model(ids, cache=DeepseekV41Cache(model.config), prefill_mode=mode, logits_to_keep=1)
            try:
                # every length warms up: kernels specialize by length (a 16K exact prefill timed without its own
                # warm-up took 7.6 s, warmed 1.52 s: H100, 2026-12-05)
                ms = timed_ms(run, repeats=1, warmup=1)
            except torch.OutOfMemoryError:
                row = {"prefill": length, "mode": mode, "result": "out of memory"}
            else:
                row = {"prefill": length, "mode": mode, "ms": ms, "tokens_per_s": length * 1e3 / ms,
                       "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("quantized", "bf16"), default="quantized")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--engram-rows", type=int, default=1 << 20)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 32], help="none: no decode rows")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384, 65536])
    parser.add_argument("--prefill-modes", nargs="+", default=["exact", "bounded_replay"])
    parser.add_argument("--skip-prefill", type=int, nargs="*", default=[],
                        help="lengths run in bounded_replay only (exact at 64K is the slow path)")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--no-dspark", action="store_true", help="skip the draft and verify step rows")
    parser.add_argument("--profile", type=int, nargs="*", metavar="BATCH",
                        help="also profile graph-replayed decode steps of these batch sizes (none given: 1)")
    parser.add_argument("--profile-verify", action="store_true",
                        help="also profile DSpark's graph-replayed verify step (block + 1 tokens, batch 1)")
    parser.add_argument("--profile-draft", action="store_true", help="also profile the drafter's replayed forward")
    parser.add_argument("--profile-prefill", type=int, default=0, metavar="TOKENS",
                        help="also profile one exact prefill of this many tokens, by kernel and by source line")
    parser.add_argument("--agent-turn", type=int, nargs=2, metavar=("PREFIX", "NEW"),
                        help="also time an agent turn: PREFIX tokens restored from a saved prefix cache + NEW tokens")
    parser.add_argument("--profile-agent-turn", action="store_true",
                        help="also profile the restored agent turn's forward (kernels, host synchronizations) and time "
                             "the parts of its restore")
    parser.add_argument("--agent-turn-mode", choices=("exact", "bounded_replay"), default="bounded_replay",
                        help="the prefill mode of both agent turns (the saved prefix, the new tokens, the cold turn)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"), help="where --agent-turn writes its cache")
    parser.add_argument("--bandwidth", type=float, default=4.8e12)
    parser.add_argument("--pdl", choices=("off", "on", "both"), default="off",
                        help="programmatic dependent launch of the kernels (both: the decode rows without, then with "
                             "it; everything after runs with it)")
    moe = parser.add_mutually_exclusive_group()
    moe.add_argument("--moe-mma", action="store_true",
                     help="decode-sized MoE calls on the tensor cores (kernels.triton.use_mma_moe; the default where "
                          "Triton has Gluon, unless DEEPSEEK_V41_MMA_MOE=0)")
    moe.add_argument("--no-moe-mma", action="store_true",
                     help="decode-sized MoE calls on the CUDA cores (the rows formulation, the FP4 tiles)")
    parser.add_argument("--linear-mma", action="store_true",
                        help="FP8 linears of up to 8 rows on the tensor cores (kernels.triton.use_mma_linears; off by "
                             "default until timed)")
    parser.add_argument("--prefetch", action="store_true",
                        help="every decode kernel issues each next slice's loads ahead: the rows linears and experts "
                             "and the tensor-core linears too (the tensor-core experts do by default; the rows kernels "
                             "were slower with it on the H100)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/realwidth.py needs a CUDA GPU.")
    from modeling_deepseek_v41.kernels.triton import use_mma_linears, use_mma_moe
    if args.moe_mma or args.no_moe_mma:  # without the flags, the defaults and DEEPSEEK_V41_MMA_MOE / _LINEARS decide
        use_mma_moe(args.moe_mma)
    if args.linear_mma:
        use_mma_linears(True)
    if args.prefetch:  # the committed tiles with the option flipped, for an A/B of the candidate
        from modeling_deepseek_v41.kernels.triton import fp4_mma, fp8_mma, linear_rows, moe_rows
        linear_rows.ROWS_TILE["prefetch"] = moe_rows.ROWS_TILE["prefetch"] = True
        fp4_mma.PREFETCH = fp8_mma.PREFETCH = True
    from modeling_deepseek_v41.kernels.triton.launch import use_pdl
    start = time.perf_counter()
    model = build(released_config(args.mode, args.experts, args.engram_rows))
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(json.dumps({"mode": args.mode, "experts": args.experts, "weights_gib": round(weights_gib, 2),
                      "build_s": round(time.perf_counter() - start, 1),
                      "device": torch.cuda.get_device_name()}), flush=True)
    for pdl in {"off": [False], "on": [True], "both": [False, True]}[args.pdl]:
        use_pdl(pdl)
        print(json.dumps({"pdl": pdl}), flush=True)
        decode_rows(model, args.context, args.batches, args.steps, args.bandwidth, eager=not args.no_eager)
    if not args.no_dspark:
        dspark_rows(model, args.context, args.steps)
    for batch in [1] if args.profile == [] else args.profile or []:
        profile_decode(model, args.context, batch=batch)
    if args.profile_verify:
        profile_decode(model, args.context, width=model.config.text_config.dspark_block_size + 1)
    if args.profile_draft:
        profile_decode(model, args.context, draft=True)
    if args.profile_prefill:
        profile_prefill(model, args.profile_prefill, "exact")
    if args.agent_turn:
        agent_turn(model, *args.agent_turn, args.workdir, args.agent_turn_mode, args.profile_agent_turn)
    skip = {("exact", n) for n in args.skip_prefill}
    prefill_rows(model, args.prefill, args.prefill_modes, skip)


if __name__ == "__main__":
    main()
