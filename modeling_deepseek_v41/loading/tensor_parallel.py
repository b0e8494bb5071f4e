"""Tensor and expert parallelism for `from_pretrained(..., tp_plan="auto")` under torchrun.

The plan (`DeepseekV41Config.base_model_tp_plan`) uses DeepSeek-V4.1's own styles, registered with transformers'
`ALL_PARALLEL_STYLES`, because the built-in ones cannot express what this model needs:

- attention (`deepseek_v41_local_heads` + `deepseek_v41_shard_rows` on `wq_b` and `wo_a`): each rank holds
  `n_heads / tp` query heads and the `o_groups / tp` output groups they feed (the grouped `wo_a` is block-diagonal
  over groups, so a rank's heads only reach its own groups), with the FP8 block scales sharded alongside their
  32-row blocks. The grouped output is all-gathered in rank order before `wo_b` (`deepseek_v41_gather_input`),
  which every rank holds whole: no partial sums, so every rank computes exactly what one process computes, FP8
  activation quantization included. The compressor, the indexer and the window KV projection are replicated (the
  indexer's top-k is over a sum across its heads, which a split would reorder).
- routed experts (`deepseek_v41_expert_slices`): each rank holds a contiguous slice of the experts and never
  allocates the others. The style sets the MoE's hook (`expert_range`, `reduce_contributions`): each rank fills
  the (token, slot) entries of its own experts and the entries are summed across ranks: every entry has exactly
  one owner, so the sum only adds exact zeros, and the per-token sum in ascending expert order then runs as in
  one process. The shared expert and the router are replicated.
- Engram tables held as parameters (`deepseek_v41_table_rows`) and the LM head (`deepseek_v41_vocab_rows`): rows
  split across ranks; the style sets the table's hook (`row_range`, `reduce_rows`): a lookup sums exact zeros from
  the non-owners; the head's logits are all-gathered.

No style replaces a `forward` or rewrites a layer's sizes: the attention reads its head and group counts from the
shapes it holds, the MoE and the Engram table have hooks for the ranges they hold and the sum across ranks.

Parameters are DTensors while loading, so each rank reads only its shards from the checkpoint; afterwards they
are turned into plain per-rank tensors (`localize_parameters`) and these styles do the communication themselves.
Inference only: the collectives here carry no gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

from ..kernels.numerics import WEIGHT_BLOCK


def _rank_and_size(mesh) -> tuple[int, int]:
    return mesh.get_local_rank(), mesh.size()


def _group(mesh):
    return mesh.get_group()


def _shard_rows(module: nn.Module, param: str, mesh) -> None:
    """Replace a (meta) parameter by a DTensor sharded on dim 0, so the loader reads only this rank's rows."""
    meta = module._parameters.get(param)
    if meta is None:
        return
    module._parameters[param] = nn.Parameter(distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None),
                                             requires_grad=meta.requires_grad)


def _row_range(rows: int, mesh) -> tuple[int, int]:
    """The rows [start, end) this rank holds under Shard(0) (torch's chunking: ceil-sized blocks)."""
    rank, size = _rank_and_size(mesh)
    chunk = -(-rows // size)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def exact_sum_(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) where each element has at most one non-zero contribution, so the sum is exact. Half
    precision goes over the wire as fp32 on backends without half-precision sums (exact both ways)."""
    if tensor.dtype in (torch.bfloat16, torch.float16) and dist.get_backend(group) != "nccl":
        wide = tensor.float()
        dist.all_reduce(wide, group=group)
        tensor.copy_(wide)
    else:
        dist.all_reduce(tensor, group=group)
    return tensor


def _all_gather_last(x: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class ShardRows(TensorParallelLayer):
    """A projection whose output rows (weight and, for FP8, its 32-row blocks of scales) are split across ranks;
    its owner (the attention) runs on the local rows, so nothing is hooked here."""

    def shard_param(self, module, param, mesh):
        tensor = module._parameters.get(param)
        if tensor is None:
            return
        _, size = _rank_and_size(mesh)
        block = WEIGHT_BLOCK if getattr(module, "storage", "dense") == "fp8" else 1
        rows = module.out_features
        if rows % (size * block):
            raise ValueError(f"{type(module).__name__} with {rows} output rows cannot be split over {size} ranks "
                             f"in whole {block}-row scale blocks.")
        _shard_rows(module, param, mesh)

    def install_forward(self, module, mesh):
        return module


class LocalHeads(TensorParallelLayer):
    """An attention layer that runs `n_heads / tp` query heads and `o_groups / tp` output groups: it holds the
    attention sinks of its heads (sharded here) and its rows of wq_b and wo_a (ShardRows), and reads its head and
    group counts from those shapes, so nothing is rewritten."""

    def shard_param(self, module, param, mesh):
        if param == "attn_sink":
            _shard_rows(module, param, mesh)

    def install_forward(self, module, mesh):
        _, size = _rank_and_size(mesh)
        if module.n_heads % size or module.n_groups % size:
            raise ValueError(f"Tensor parallelism over {size} ranks needs num_attention_heads ({module.n_heads}) and "
                             f"o_groups ({module.n_groups}) divisible by {size}.")
        return module


class GatherInput(TensorParallelLayer):
    """A projection held whole on every rank whose input arrives split over ranks along its last dim."""

    def install_forward(self, module, mesh):
        group, (_, size) = _group(mesh), _rank_and_size(mesh)

        def gather(_module, args):
            return (_all_gather_last(args[0], group, size),) + tuple(args[1:])

        module.register_forward_pre_hook(gather)
        return module


class VocabRows(TensorParallelLayer):
    """The LM head with its vocabulary rows split across ranks; the logits are all-gathered."""

    def shard_param(self, module, param, mesh):
        _shard_rows(module, param, mesh)

    def install_forward(self, module, mesh):
        group, (_, size) = _group(mesh), _rank_and_size(mesh)
        vocab = module.out_features
        chunk = -(-vocab // size)

        def gather(_module, _args, output):
            padded = nn.functional.pad(output, (0, chunk - output.shape[-1]))  # the last rank may hold fewer rows
            return _all_gather_last(padded, group, size)[..., :vocab]

        module.register_forward_hook(gather)
        return module


class TableRows(TensorParallelLayer):
    """An Engram table (held as parameters) with its rows split across ranks. The style sets the table's hook
    (`row_range`, `reduce_rows`): each rank looks up the rows it holds, zeros elsewhere, and the ranks' results
    are summed (exactly: one owner per row)."""

    def shard_param(self, module, param, mesh):
        _shard_rows(module, param, mesh)

    def install_forward(self, module, mesh):
        if module._parameters.get("weight") is None:  # host/mmap storage: every rank reads the shared file
            return module
        group = _group(mesh)
        module.row_range = _row_range(module.weight.shape[0], mesh)
        module.reduce_rows = lambda rows: exact_sum_(rows, group)
        return module


class RemoteExpert(nn.Module):
    """Stands in for a routed expert that another tensor-parallel rank holds (no parameters)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("This expert is held by another tensor-parallel rank.")


class ExpertSlices(TensorParallelLayer):
    """An MoE layer whose routed experts are split into contiguous slices, one per rank."""

    def install_forward(self, module, mesh):
        rank, size = _rank_and_size(mesh)
        chunk = -(-module.n_experts // size)
        start, end = min(module.n_experts, rank * chunk), min(module.n_experts, (rank + 1) * chunk)
        for expert_id in range(module.n_experts):
            if not start <= expert_id < end:
                module.experts[expert_id] = RemoteExpert()  # never allocated on this rank
        group = _group(mesh)
        module.expert_range = (start, end)  # the MoE runs only these experts and sums the ranks' contributions
        module.reduce_contributions = lambda contributions: exact_sum_(contributions, group)
        return module


STYLES = {
    "deepseek_v41_local_heads": LocalHeads(),
    "deepseek_v41_shard_rows": ShardRows(),
    "deepseek_v41_gather_input": GatherInput(),
    "deepseek_v41_expert_slices": ExpertSlices(),
    "deepseek_v41_table_rows": TableRows(),
    "deepseek_v41_vocab_rows": VocabRows(),
}


def tensor_parallel_requested(kwargs: dict) -> bool:
    """Whether a from_pretrained call asks for tensor parallelism: `tp_plan` / `tp_size` / `device_mesh`, or a
    `distributed_config` (DistributedConfig or dict) with a `tp_plan` or a `tp_size` above 1."""
    if any(kwargs.get(key) is not None for key in ("tp_plan", "tp_size", "device_mesh")):
        return True
    distributed = kwargs.get("distributed_config")
    if distributed is None:
        return False
    if isinstance(distributed, dict):
        tp_plan, tp_size = distributed.get("tp_plan"), distributed.get("tp_size")
    else:
        tp_plan, tp_size = getattr(distributed, "tp_plan", None), getattr(distributed, "tp_size", None)
    return tp_plan is not None or (tp_size or 1) > 1


def register_parallel_styles() -> None:
    """Make the styles of `DeepseekV41Config.base_model_tp_plan` known to transformers (done by from_pretrained
    when a tensor-parallel plan is used; registering again is harmless)."""
    for name, style in STYLES.items():
        ALL_PARALLEL_STYLES.register(name, style)


def localize_parameters(model: nn.Module) -> bool:
    """Turn every DTensor parameter into this rank's plain local tensor (the styles above communicate
    explicitly). Returns whether there were any."""
    found = False
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                module._parameters[name] = nn.Parameter(param.to_local(), requires_grad=param.requires_grad)
                found = True
    if found:
        model._tp_localized = True
    return found
