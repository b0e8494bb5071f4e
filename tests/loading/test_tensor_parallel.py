"""Tensor/expert parallelism: two CPU processes (gloo) with `tp_plan="auto"` give one process's logits, bit for bit."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import modeling_deepseek_v41  # noqa: F401
from model_factory import random_model, tiny_config
from modeling_deepseek_v41.loading.tensor_parallel import RemoteExpert
from reference_cases import FIXTURES

CHECKPOINT = str(FIXTURES / "tiny-text" / "checkpoint")


def _inputs() -> torch.Tensor:
    return torch.randint(3, 500, (2, 37), generator=torch.Generator().manual_seed(7))


def _outputs(model) -> dict[str, torch.Tensor]:
    """Full-forward logits, and a cached prefill + two single-token decode steps."""
    ids = _inputs()
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :30], use_cache=True)
        cache, steps = out.cache, [out.logits[:, -1]]
        for position in range(30, 32):
            out = model(ids[:, position:position + 1], cache=cache)
            steps.append(out.logits[:, -1])
    return {"full": full, "decode": torch.stack(steps, dim=1)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, folder: str, dense_folder: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        results = {}
        # first, so that no earlier tp_plan load has registered the plan's styles: the DistributedConfig form
        dense = AutoModelForCausalLM.from_pretrained(dense_folder, distributed_config=DistributedConfig(tp_plan="auto"),
                                                     dtype=torch.float64)
        results["float64"] = _outputs(dense)
        results["float64_heads"] = dense.model.layers[1].attn.n_heads
        model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto")
        results["quantized"] = _outputs(model)
        ffn = model.model.layers[1].ffn
        results["layout"] = {
            "wq_b_rows": model.model.layers[1].attn.wq_b.weight.shape[0],
            "wq_b_scale_rows": model.model.layers[1].attn.wq_b.scale.shape[0],
            "heads": model.model.layers[1].attn.n_heads,
            "expert_range": ffn.expert_range,
            "remote": [i for i, e in enumerate(ffn.experts) if isinstance(e, RemoteExpert)],
            "table_rows": model.model.layers[1].engram.embed.weight.shape[0],
            "table_row_range": model.model.layers[1].engram.embed.row_range,
            "patched_forwards": [name for name, m in model.named_modules() if "forward" in vars(m)],
            "head_rows": model.lm_head.weight.shape[0],
        }
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    """A random dense (bf16-weight-mode layout) float64 model with the DSpark drafter, saved."""
    folder = str(tmp_path_factory.mktemp("dense"))
    random_model(tiny_config(), dtype=torch.float64).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory, dense_folder):
    folder = str(tmp_path_factory.mktemp("tp"))
    mp.spawn(_worker, args=(2, _free_port(), folder, dense_folder), nprocs=2)
    return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)]


def test_two_gloo_ranks_give_one_process_logits(two_rank_results, dense_folder):
    """The quantized fixture (FP8/FP4) and a dense float64 model; full forward and cached decode; both ranks.
    No partial sums are reduced across ranks (see tensor_parallel.py), so only GEMM widths differ."""
    for mode, folder, kwargs in (("quantized", CHECKPOINT, {}), ("float64", dense_folder, {"dtype": torch.float64})):
        expected = _outputs(AutoModelForCausalLM.from_pretrained(folder, **kwargs))
        for rank in range(2):
            for name, value in expected.items():
                got = two_rank_results[rank][mode][name]
                if mode == "quantized":  # FP8/FP4 weights, fp32 GEMMs of any width: bit-identical
                    assert torch.equal(got, value), f"{name} on rank {rank}: max diff {(got - value).abs().max()}"
                else:  # float64 GEMMs of half the width sum in another order: ~3e-14 measured
                    torch.testing.assert_close(got, value, rtol=1e-10, atol=1e-10)


def test_each_rank_holds_its_shards(two_rank_results):
    """Rank r: half the query heads (FP8 scale blocks alongside), experts 4r..4r+3 only, half the Engram and head rows."""
    for rank, results in enumerate(two_rank_results):
        layout = results["layout"]
        assert layout["heads"] == 2 and layout["wq_b_rows"] == 2 * 64 and layout["wq_b_scale_rows"] == 2 * 64 // 32
        assert layout["expert_range"] == (4 * rank, 4 * rank + 4)
        assert layout["remote"] == [i for i in range(8) if not 4 * rank <= i < 4 * rank + 4]
        assert layout["table_rows"] == 6126 // 2 and layout["head_rows"] == 512 // 2
        assert layout["table_row_range"] == (3063 * rank, 3063 * (rank + 1))
        assert layout["patched_forwards"] == []  # the styles set the layers' hooks, never replace a forward
        assert results["float64_heads"] == 2  # distributed_config=DistributedConfig(tp_plan="auto") shards too
