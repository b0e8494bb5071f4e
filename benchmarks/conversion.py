"""Peak memory and wall time of the streaming converters on a synthetic checkpoint of several hundred MB.

    PYTHONPATH=. python benchmarks/conversion.py [--workdir DIR] [--keep] [--results benchmarks/conversion_results.md]

Builds a random hub-layout checkpoint (the `small` preset widened, with two ~200 MB Engram tables so that single
tensors are larger than the chunk size, as in the released model) in many shards, then runs each converter as a
separate process under `/usr/bin/time -v` (falling back to getrusage of the child) and records its peak RSS next to
the largest source shard, plus the RSS of a process that only imports the converter (the fixed cost of Python,
torch and transformers). The round trips are checked to be bit-identical.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BENCH_TEXT_CONFIG = {
    "hidden_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 32, "vocab_size": 32768,
    "engram_vocab_size": 700_000, "engram_head_dim": 64,
}
BENCH_SHARD_SIZE = "64MB"


def run_measured(args: list[str]) -> tuple[float, float, int]:
    """Run a command; return (wall seconds, user+system CPU seconds, peak RSS in bytes) of the child."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    if shutil.which("time") or Path("/usr/bin/time").exists():
        result = subprocess.run(["/usr/bin/time", "-v", *args], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            raise RuntimeError(f"{args} failed:\n{result.stderr[-3000:]}")
        peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1))
        cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", result.stderr).group(1))
                  for kind in ("User", "System"))
        return wall, cpu, peak_kb * 1024
    # without GNU time: wrap the command in a fresh interpreter so RUSAGE_CHILDREN covers this child only
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
               "print(u.ru_maxrss, u.ru_utime + u.ru_stime); sys.exit(r.returncode)")
    result = subprocess.run([sys.executable, "-c", wrapper, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{result.stderr[-3000:]}")
    peak_kb, cpu = result.stdout.strip().splitlines()[-1].split()
    return wall, float(cpu), int(peak_kb) * 1024


def folder_stats(folder: Path) -> dict:
    shards = sorted(folder.glob("model-*.safetensors"))
    sizes = [p.stat().st_size for p in shards]
    return {"shards": len(shards), "total_bytes": sum(sizes), "largest_shard_bytes": max(sizes)}


def bit_identical(a: Path, b: Path) -> bool:
    """Every tensor of two checkpoints has the same dtype, shape and bytes (read one tensor at a time)."""
    import torch

    from modeling_deepseek_v41.loading.safetensors_file import safetensors_entries

    def sources(folder: Path) -> dict:
        found = {}
        for shard in sorted(folder.glob("model-*.safetensors")):
            found.update(safetensors_entries(shard))
        return found

    left, right = sources(a), sources(b)
    if set(left) != set(right):
        return False
    for name, source in left.items():
        other = right[name]
        if (source.shape, source.dtype) != (other.shape, other.dtype):
            return False
        if not torch.equal(source.read_rows().view(-1).view(torch.uint8), other.read_rows().view(-1).view(torch.uint8)):
            return False
    return True


def machine() -> str:
    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        match = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        cpu = match.group(1).strip() if match else cpu
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB RAM, {platform.system()} {platform.release()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/deepseek-v41-conversion-bench"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--engram-vocab-size", type=int, default=BENCH_TEXT_CONFIG["engram_vocab_size"],
                        help="scales the two Engram tables (3000000 gives a checkpoint of about 2.7 GB)")
    parser.add_argument("--results", type=Path, default=None, help="also write a markdown report here")
    args = parser.parse_args()
    from conversion_scripts.make_random_checkpoint import make_random_checkpoint

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    start = time.perf_counter()
    text_config = {**BENCH_TEXT_CONFIG, "engram_vocab_size": args.engram_vocab_size}
    hub = make_random_checkpoint(work / "hub", text_config, preset="small", max_shard_size=BENCH_SHARD_SIZE)
    build_seconds = time.perf_counter() - start
    python = sys.executable
    runs = [
        ("hub -> native (bf16)", ["-m", "conversion_scripts.convert_hub_to_native", "--src", "hub", "--dst",
                                  "native_bf16", "--weight-mode", "bf16", "--quiet"], "hub"),
        ("native (bf16) -> hub", ["-m", "conversion_scripts.convert_native_to_hub", "--src", "native_bf16", "--dst",
                                  "hub_from_bf16", "--quiet"], "native_bf16"),
        ("hub -> native (quantized)", ["-m", "conversion_scripts.convert_hub_to_native", "--src", "hub", "--dst",
                                       "native_quantized", "--weight-mode", "quantized", "--quiet"], "hub"),
        ("native (quantized) -> hub", ["-m", "conversion_scripts.convert_native_to_hub", "--src", "native_quantized",
                                       "--dst", "hub_from_quantized", "--quiet"], "native_quantized"),
    ]
    _, _, baseline = run_measured([python, "-c", "import conversion_scripts.convert_hub_to_native, "
                                               "conversion_scripts.convert_native_to_hub"])
    rows = []
    for title, command, source in runs:
        absolute = [python] + [str(work / a) if a in ("hub", "native_bf16", "native_quantized", "hub_from_bf16",
                                                      "hub_from_quantized") else a for a in command]
        wall, cpu, peak = run_measured(absolute)
        stats = folder_stats(work / source)
        out_stats = folder_stats(work / command[command.index("--dst") + 1])
        rows.append({"run": title, "command": "python " + " ".join(command), "wall_s": round(wall, 1),
                     "cpu_s": round(cpu, 1),
                     "peak_rss_mb": round(peak / 2**20), "source_total_mb": round(stats["total_bytes"] / 2**20),
                     "source_shards": stats["shards"],
                     "largest_source_shard_mb": round(stats["largest_shard_bytes"] / 2**20),
                     "largest_output_shard_mb": round(out_stats["largest_shard_bytes"] / 2**20),
                     "ratio": round(peak / stats["largest_shard_bytes"], 2),
                     "above_import_mb": round((peak - baseline) / 2**20)})
    checks = {"bf16 round trip bit-identical": bit_identical(work / "hub", work / "hub_from_bf16"),
              "quantized round trip bit-identical": bit_identical(work / "hub", work / "hub_from_quantized")}
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "python": platform.python_version(),
              "build_seconds": round(build_seconds, 1), "import_only_rss_mb": round(baseline / 2**20),
              "text_config": text_config,
              "hub_checkpoint": folder_stats(hub), "runs": rows, "checks": checks,
              "own_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    print(json.dumps(report, indent=2))
    if args.results:
        args.results.write_text(render_markdown(report))
    if not args.keep:
        shutil.rmtree(work)


def render_markdown(report: dict) -> str:
    hub = report["hub_checkpoint"]
    lines = [
        "# Conversion benchmark results",
        "",
        "Produced by `PYTHONPATH=. python benchmarks/conversion.py` with the options recorded below.",
        "",
        f"- date: {report['date']}",
        f"- machine: {report['machine']}, Python {report['python']}",
        f"- synthetic hub checkpoint: `make_random_checkpoint` preset `small` with {report['text_config']}, "
        f"max shard size {BENCH_SHARD_SIZE}: {hub['total_bytes'] / 2**20:.0f} MiB in {hub['shards']} shards, "
        f"largest shard {hub['largest_shard_bytes'] / 2**20:.0f} MiB (built in {report['build_seconds']} s)",
        f"- RSS of a process that only imports the converters (Python + torch + transformers): "
        f"{report['import_only_rss_mb']} MiB",
        "- peak RSS: `/usr/bin/time -v` \"Maximum resident set size\" of the converter process",
        "",
        "| run | wall (s) | CPU user+sys (s) | peak RSS (MiB) | above import (MiB) | largest source shard (MiB) "
        "| peak / largest shard | largest output shard (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        lines.append(f"| `{row['command']}` | {row['wall_s']} | {row['cpu_s']} | {row['peak_rss_mb']} | "
                     f"{row['above_import_mb']} | "
                     f"{row['largest_source_shard_mb']} | {row['ratio']}x | {row['largest_output_shard_mb']} |")
    lines += ["", "Checks: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in report["checks"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
