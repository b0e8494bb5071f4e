"""from_pretrained of a hub-layout checkpoint at the released widths, against the disk's own read rate.

    python benchmarks/loading.py [--layers 3] [--experts 384] [--workdir DIR] [--device cuda] [--keep] [--tiny]
                                 [--variants one_thread willneed]

Writes a random checkpoint in the hub layout whose layers have the released shapes and all 384 routed experts
(`--layers` decoder blocks on a CSA2 schedule of window-only, ratio-2 and ratio-1 layers; the Engram tables and the
drafter's experts cut), its tensors drawn on `--device` and written in shards of `--shard-gb`. Then, each time after
dropping the checkpoint's files from the page cache (posix_fadvise DONTNEED after a sync): the disk's sequential read
rate of the shards, and `AutoModelForCausalLM.from_pretrained(folder, device_map=device)` in a fresh process (wall
seconds, GB/s, peak host RSS, seconds per step of the loading pipeline); and the same load once more with the files
cached; with `--variants`, more cold loads through other read paths (transformers' loader on one thread; each shard
advised into the page cache ahead of the loader). The released checkpoint's load time is estimated from the cold rate
and its size (the hub config's tensors). `--tiny` keeps the schedule and the 384 experts at the tiny preset's widths: a
quick run on a CPU; `--experts` cuts the routed experts for a host with less memory. The tokenizer written beside it has
the released vocabulary's size and, like the hub's, few added tokens (transformers loads 100K of them in seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conversion_scripts.make_random_checkpoint import _complete_text_config, hub_config_dict  # noqa: E402
from conversion_scripts.presets import TINY_TEXT  # noqa: E402
from conversion_scripts.tiny_tokenizer import save_tiny_tokenizer  # noqa: E402
from modeling_deepseek_v41 import DeepseekV41Config  # noqa: E402
from modeling_deepseek_v41.model.checkpoint import expected_tensors  # noqa: E402

OFFICIAL = ROOT / "tests" / "fixtures" / "spec" / "official_config.json"
WIDTHS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "head_dim",
          "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "index_n_heads", "index_head_dim",
          "index_topk", "candidate_topk_blocks", "candidate_block_size", "engram_n_heads", "engram_head_dim",
          "dspark_markov_rank", "sliding_window", "max_position_embeddings", "rope_scaling")
CHUNK = 64 << 20  # bytes per read when timing the disk


def text_config(layers: int, tiny: bool, experts: int = 384) -> dict:
    """The hub text config with `layers` blocks (0: window only, 1: ratio 2, later: ratio 1; the first ratio-1
    block owns the candidates) and cut Engram tables and drafter experts; with `tiny`, the tiny preset's widths.
    The ids the tokenizer decides (noise token, compressed Engram vocabulary, table rows) are left out."""
    if layers < 3:
        raise ValueError("--layers must be at least 3 (a window-only, a ratio-2 and a ratio-1 block)")
    text = dict(json.loads(OFFICIAL.read_text())["text_config"])
    if tiny:
        text.update({key: TINY_TEXT[key] for key in WIDTHS})
    text.update(num_hidden_layers=layers, compress_ratios=[0, 2] + [1] * (layers - 2) + [0] * 3,
                kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2], candidate_source_layer_id=2,
                engram_layer_ids=[1, 2], dspark_target_layer_ids=[layers - 3, layers - 2, layers - 1],
                dspark_n_routed_experts=16, engram_vocab_size=100_000 if not tiny else 1000, n_routed_experts=experts)
    for key in ("dspark_noise_token_id", "engram_compressed_vocab_size", "engram_num_embeddings"):
        text.pop(key)
    return text


def random_tensor(shape: tuple, dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    """Random finite values: bytes for the stored formats (e4m3 without its NaN codes, every packed e2m1 pair,
    E8M0 scales near 1), small normals for floats (the loader refuses non-finite weights)."""
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(shape, device=device, generator=generator) * 0.02).to(dtype)

    def draw(low, high):
        return torch.randint(low, high, shape, device=device, generator=generator, dtype=torch.int32)
    if dtype == torch.float8_e8m0fnu:
        raw = draw(118, 124)
    elif dtype == torch.float8_e4m3fn:
        raw = draw(0, 127) | (draw(0, 2) << 7)  # magnitude codes 0..126: 127 is NaN
    else:
        raw = draw(0, 256)
    return raw.to(torch.uint8).view(dtype)


def write_checkpoint(folder: Path, config_dict: dict, device: str, shard_bytes: int) -> tuple[int, float]:
    """The hub-layout shards (each drawn and written before the next, so the host holds one at a time), index and
    config.json; returns (bytes written, seconds)."""
    from safetensors.torch import save_file

    config = DeepseekV41Config(**json.loads(json.dumps(config_dict)))
    plan, size = [[]], 0
    for name, (shape, dtype) in expected_tensors(config, hub_layout=True).items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if plan[-1] and size + nbytes > shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, tuple(shape), dtype))
        size += nbytes
    generator = torch.Generator(device=device).manual_seed(0)
    folder.mkdir(parents=True)
    start, total, weight_map = time.perf_counter(), 0, {}
    for index, entries in enumerate(plan):
        filename = f"model-{index + 1:05d}-of-{len(plan):05d}.safetensors"
        shard = {name: random_tensor(shape, dtype, device, generator).cpu() for name, shape, dtype in entries}
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
        total += sum(t.nbytes for t in shard.values())
        weight_map.update(dict.fromkeys(shard, filename))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2))
    os.sync()
    return total, time.perf_counter() - start


def drop_cached(folder: Path) -> None:
    """Ask the kernel to drop the folder's files from the page cache (clean pages go; no root needed)."""
    os.sync()
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate(folder: Path) -> tuple[float, float]:
    """(GB/s, seconds) of reading every shard once, sequentially, in CHUNK-sized reads."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    total, start = 0, time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as handle:
            while (count := handle.readinto(view)) > 0:
                total += count
    seconds = time.perf_counter() - start
    return total / seconds / 1e9, seconds


LOAD = """
import json, resource, sys, time
import torch
sys.path.insert(0, {root!r})
import modeling_deepseek_v41  # noqa: F401
from modeling_deepseek_v41.loading import pipeline
from transformers import AutoModelForCausalLM
steps = {{}}


def timed(step):
    def run(request):
        begin = time.perf_counter()
        step(request)
        if {device!r}.startswith("cuda"):
            torch.cuda.synchronize()
        steps[step.__name__] = round(time.perf_counter() - begin, 3)
    return run


# the variant "willneed": each shard advised into the page cache in file order, from a thread, as the loader
# starts (the kernel reads ahead in large requests; the loader's threads then find the pages)
def read_ahead(request):
    import os, threading
    from pathlib import Path

    def advise():
        for path in sorted(Path({folder!r}).glob("*.safetensors")):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            os.close(fd)
    threading.Thread(target=advise, daemon=True).start()


steps_in_order = list(pipeline.STEPS)
if {variant!r} == "willneed":
    steps_in_order.insert(steps_in_order.index(pipeline.load_weights), read_ahead)
pipeline.STEPS = tuple(timed(step) for step in steps_in_order)  # where the seconds go: transformers' load or ours
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained({folder!r}, device_map={device!r})
if {device!r}.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
on_device = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({{"seconds": seconds, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "parameter_gb": on_device / 1e9, "device": str(next(model.parameters()).device),
                  "steps_s": steps}}))
"""


VARIANTS = ("default", "one_thread", "willneed")  # read paths of --variants: transformers' 4 threads, 1, read-ahead


def timed_load(folder: Path, device: str, variant: str = "default") -> dict:
    """from_pretrained in a fresh process (its own peak RSS, no state from this one)."""
    code = LOAD.format(root=str(ROOT), folder=str(folder), device=device, variant=variant)
    env = {**os.environ, **({"HF_DEACTIVATE_ASYNC_LOAD": "1"} if variant == "one_thread" else {})}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"from_pretrained failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def released_bytes() -> int:
    """Bytes of the released checkpoint's tensors, as the hub config lists them."""
    raw = json.loads(OFFICIAL.read_text())
    config = DeepseekV41Config(**raw)
    return sum(torch.Size(shape).numel() * dtype.itemsize
               for shape, dtype in expected_tensors(config, hub_layout=True).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/deepseek-v41-loading-bench"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--tiny", action="store_true", help="the tiny preset's widths (a quick CPU run)")
    parser.add_argument("--experts", type=int, default=384, help="routed experts per block (fewer: a checkpoint that "
                        "fits a smaller host)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--variants", nargs="*", default=[], choices=VARIANTS[1:],
                        help="also time cold loads through these read paths (instruments, not package options)")
    args = parser.parse_args()
    text = text_config(args.layers, args.tiny, args.experts)
    folder = args.workdir / "hub"
    shutil.rmtree(args.workdir, ignore_errors=True)
    tokenizer = args.workdir / "tokenizer"  # the hub ships one; the Engram token map is built from it at load
    ids = save_tiny_tokenizer(tokenizer, text["vocab_size"], reserved_in_vocab=True)  # loads as fast as the hub's
    config_dict = hub_config_dict(_complete_text_config(text, ids, tokenizer), None, ids.image_token_id)
    nbytes, write_seconds = write_checkpoint(folder, config_dict, args.device, int(args.shard_gb * 1e9))
    for path in tokenizer.iterdir():
        shutil.copy2(path, folder / path.name)
    row = {"layers": args.layers, "experts": args.experts, "tiny": args.tiny, "checkpoint_gb": nbytes / 1e9,
           "shards": len(list(folder.glob("*.safetensors"))), "write_gb_s": nbytes / write_seconds / 1e9}
    drop_cached(folder)
    row["disk_read_gb_s"], row["disk_read_s"] = read_rate(folder)
    row["cached_read_gb_s"], _ = read_rate(folder)  # far above the first: the drop worked
    drop_cached(folder)
    cold = timed_load(folder, args.device)
    warm = timed_load(folder, args.device)
    row.update({"load_cold_s": cold["seconds"], "load_cold_gb_s": nbytes / cold["seconds"] / 1e9,
                "load_warm_s": warm["seconds"], "load_warm_gb_s": nbytes / warm["seconds"] / 1e9,
                "cold_over_disk": nbytes / cold["seconds"] / 1e9 / row["disk_read_gb_s"],
                "peak_host_rss_gb": cold["peak_rss_gb"], "loaded_parameter_gb": cold["parameter_gb"],
                "loaded_on": cold["device"], "cold_steps_s": cold["steps_s"], "warm_steps_s": warm["steps_s"]})
    for variant in args.variants:
        drop_cached(folder)
        timed = timed_load(folder, args.device, variant)
        row[f"load_cold_{variant}_gb_s"] = nbytes / timed["seconds"] / 1e9
        row[f"cold_steps_{variant}_s"] = timed["steps_s"]
    released = released_bytes()
    row["released_checkpoint_gb"] = released / 1e9
    row["released_load_estimate_s"] = released / (row["load_cold_gb_s"] * 1e9)
    row["released_disk_read_estimate_s"] = released / (row["disk_read_gb_s"] * 1e9)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
