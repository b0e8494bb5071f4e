"""On a machine with two CUDA GPUs: the CSA2-aware device_map split over cuda:0/cuda:1 and a torchrun two-process
tensor/expert-parallel run on NCCL give one device's logits. Prints PASS/FAIL per check with the max differences.

    python benchmarks/two_gpu_check.py            # about 2 minutes; launches torchrun itself for the TP part

Models: the quantized tiny-text fixture (FP8/FP4 weights, bf16 activations, the GPU fast paths) and a random dense
float64 model with the DSpark drafter (exact paths). Each is run as a full forward over 40 tokens and as a cached
prefill of 36 tokens plus 3 single-token decode steps. torch.compile is off unless --compile is given (the
placement is what is checked here; compiling every process would take most of the time budget).

Criteria: the device_map split runs the same kernels as one device, so its logits must be identical. Under tensor
parallelism the query-projection GEMMs are half as wide and cuBLAS may sum them in another order: float64 must
agree within 1e-10 (relative); the bf16 quantized model within bf16 rounding amplified by the FP8 activation
quantization, checked as top-1 agreement of every position and max |diff| <= 2% of the largest logit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-text" / "checkpoint"


def outputs(model, device) -> dict:
    import torch

    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(11)).to(device)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :36], use_cache=True)
        steps = [out.logits[:, -1]]
        for position in range(36, 39):
            out = model(ids[:, position:position + 1], cache=out.cache)
            steps.append(out.logits[:, -1])
    return {"full": full.float().cpu() if full.dtype != torch.float64 else full.cpu(),
            "decode": torch.stack(steps, 1).cpu()}


def load(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    import modeling_deepseek_v41  # noqa: F401

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def compare(label: str, got: dict, want: dict, mode: str) -> bool:
    import torch

    ok = True
    for name in want:
        a, b = got[name].double(), want[name].double()
        diff = (a - b).abs().max().item()
        scale = b.abs().max().item()
        if mode == "exact":
            passed = torch.equal(got[name], want[name])
        elif mode == "float64":
            passed = diff <= 1e-10 * max(scale, 1.0)
        else:
            passed = bool((a.argmax(-1) == b.argmax(-1)).all()) and diff <= 0.02 * scale
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'}  {label:<58} {name:<6} max|diff| {diff:.3e} (max|logit| {scale:.2f})")
    return ok


def tp_worker(folder: str, out: str) -> None:
    import torch

    rank = int(os.environ["RANK"])
    results = {}
    for name, path, kwargs in (("quantized", str(FIXTURE), {}), ("float64", folder, {"dtype": torch.float64})):
        model = load(path, tp_plan="auto", **kwargs)
        results[name] = outputs(model, model.device)
        results[name + "_layout"] = (model.model.layers[1].attn.n_heads, model.model.layers[1].ffn.expert_range, str(model.device))
    if rank == 0:
        torch.save(results, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp-worker", nargs=2, metavar=("FLOAT64_FOLDER", "OUT"))
    parser.add_argument("--compile", action="store_true", help="keep the torch.compile fast paths on")
    args = parser.parse_args()
    if not args.compile:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    if args.tp_worker:
        tp_worker(*args.tp_worker)
        return 0

    import torch

    if torch.cuda.device_count() < 2:
        print(f"FAIL  needs two CUDA GPUs, found {torch.cuda.device_count()}")
        return 1
    from model_factory import random_model, tiny_config
    from modeling_deepseek_v41.loading.device_map import spread_units

    work = tempfile.mkdtemp()
    dense = os.path.join(work, "dense64")
    random_model(tiny_config(), dtype=torch.float64).save_pretrained(dense)
    ok = True
    split_memory = {0: 6 * 2**20, 1: 2**30}  # GPU 0 too small for every MoE layer: most go to GPU 1
    for name, folder, kwargs, mode in (("quantized", str(FIXTURE), {}, "exact"),
                                       ("float64", dense, {"dtype": torch.float64}, "exact")):
        single = outputs(load(folder, device_map="cuda:0", **kwargs), "cuda:0")
        for storage in ("device", "host"):
            model = load(folder, device_map="auto", max_memory=split_memory, engram_storage=storage, **kwargs)
            devices = {str(model.hf_device_map[u]) for u in spread_units(model)}
            attention = {str(p.device) for n, p in model.named_parameters() if ".attn." in n}
            label = f"device_map {name}, tables {storage}, MoE on {sorted(devices)}"
            print(f"      {label}: attention on {sorted(attention)}")
            if devices != {"0", "1"} and devices != {"1"}:
                print(f"FAIL  {label}: the MoE layers were not spread to cuda:1")
                ok = False
            ok &= compare(label, outputs(model, "cuda:0"), single, mode)
            del model
        globals()[f"single_{name}"] = single
    out = os.path.join(work, "tp.pt")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--tp-worker", dense, out] + (["--compile"] if args.compile else [])
    run = subprocess.run(command, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])})
    if run.returncode != 0:
        print(f"FAIL  torchrun tensor-parallel run exited with {run.returncode}")
        return 1
    results = torch.load(out)
    for name, mode in (("quantized", "approx"), ("float64", "float64")):
        heads, experts, device = results[name + "_layout"]
        label = f"tp_plan=auto on NCCL {name} (rank 0: {heads} heads, experts {experts}, {device})"
        ok &= compare(label, results[name], globals()[f"single_{name}"], mode)
    print("PASS  all checks" if ok else "FAIL  some checks failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
