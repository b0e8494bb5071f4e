"""Launches the decode-shaped Triton kernels at the released shapes twice each, for Nsight Compute.

One activation row (or one token for the MoE: 384 FP4 experts, top-6), random weights in the stored formats:

    ncu --clock-control none --set full --kernel-name regex:"_linear_rows_kernel|_moe_rows_.*|_fp4_mma_kernel" \\
        -o probe python3 benchmarks/ncu_probe.py [wq_a wq_b wo_b shared_w1 moe]
    ncu --import probe.ncu-rep --page details

(the MoE takes the tensor cores where Triton has Gluon, the rows kernels with `DEEPSEEK_V41_MMA_MOE=0`;
`bash benchmarks/ncu_decode_gpu.sh` runs both.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from modeling_deepseek_v41.kernels.triton import fp8_linear, grouped_moe  # noqa: E402
from triton_kernels import LINEARS, random_fp4, random_fp8  # noqa: E402

SHAPES = {name: (n, k) for name, n, k in LINEARS}


def main() -> None:
    for name in sys.argv[1:] or ["wq_a", "wq_b", "wo_b", "moe"]:
        if name == "moe":
            e, d, inter = 384, 5120, 2304
            (w1,), (s1,) = random_fp4((inter, d), 1, e)
            (w3,), (s3,) = random_fp4((inter, d), 1, e)
            (w2,), (s2,) = random_fp4((d, inter), 1, e)
            x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
            route = torch.randperm(e, device="cuda")[:6].view(1, 6)
            for _ in range(2):
                grouped_moe(x, route, torch.rand(1, 6, device="cuda"), w1, s1, w3, s3, w2, s2, 10.0)
        else:
            n, k = SHAPES[name]
            (w,), (s,) = random_fp8(n, k, 1)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                fp8_linear(x, w, s)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
