"""Convert a checkpoint in the hub layout (as released) into the layout `save_pretrained` writes.

    python -m conversion_scripts.convert_hub_to_native --src HUB_DIR --dst OUT_DIR [--weight-mode bf16|quantized]

- `--weight-mode bf16` (default): every FP8/FP4 weight and Engram table is dequantized exactly to bf16 and the
  scales leave the model's tensors; the config loses `quantization_config` and gets `weight_mode: "bf16"`. The
  hub's scales are kept in `hub_scales-*.safetensors` next to the weights (unless `--no-hub-scales`), so that
  `convert_native_to_hub` can reproduce the hub's bytes exactly.
- `--weight-mode quantized`: the FP8/FP4 bytes and scales are kept, with the quantization_config.
In both modes fp32-held tensors are written in fp32 and `engram_token_map` is built from the source tokenizer.
NaN/Inf values (FP8 NaN codes and E8M0 0xFF scales included) are refused, naming the tensor, unless
`--keep-non-finite`. An interrupted run resumes: finished shards are reused only if their sha256 still matches.
Exit codes: 0 done, 1 conversion failed (the temporary folder is kept; rerun to resume), 2 bad arguments,
3 invalid source checkpoint (nothing written), 4 destination exists, 5 non-finite weights refused.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from .cli import run_cli
from .layout import (
    SIDECAR_PREFIX, CheckpointError, copy_auxiliary_files, inspect_source, load_config, quantized_weight_kinds,
    scale_name, source_files, with_weight_mode, write_native_config,
)
from .safetensors_io import PlannedTensor
from .streaming import OutputGroup, parse_size, plan_fingerprint, plan_shards, source_identity, write_index, \
    write_shards
from .tensor_ops import DEFAULT_CHUNK_BYTES, copy_cast, dequantize


def engram_token_map(src: Path, config) -> torch.Tensor:
    """The Engram compressed token map built from the source folder's tokenizer."""
    from modeling_deepseek_v41.loading.loader import compressed_token_map, load_tokenizer_for_token_map

    text = config.text_config
    try:
        tokenizer = load_tokenizer_for_token_map(str(src))
        return compressed_token_map(tokenizer, text.vocab_size, text.engram_compressed_vocab_size)
    except ValueError as error:
        raise CheckpointError(str(error)) from error


def build_groups(src: Path, config, weight_mode: str, keep_hub_scales: bool, chunk_bytes: int) -> list[OutputGroup]:
    """Output groups in source order; validates the source first (raises CheckpointError, naming the problem)."""
    from modeling_deepseek_v41.loading.loader import hub_name
    from modeling_deepseek_v41.model.checkpoint import expected_tensors

    if config.checkpoint_quantization is None:
        raise CheckpointError(f"{src} has no quantization_config: it is not in the hub layout.")
    sources = inspect_source(src, config, hub_layout=True)
    native = with_weight_mode(config, weight_mode)
    kinds = quantized_weight_kinds(config) if weight_mode == "bf16" else {}
    first_shard = source_files(sources)[0].name
    groups = []
    for name, (shape, dtype) in expected_tensors(native, hub_layout=False).items():  # the model's names
        hub = hub_name(name)
        planned = [PlannedTensor(name, shape, dtype)]
        if hub == "engram_token_map":
            pieces = [(name, 0, engram_token_map(src, config))]
            groups.append(OutputGroup(planned, partial(iter, pieces), first_shard))
        elif hub in kinds:
            weight, scale = sources[hub], sources[scale_name(hub)]
            produce = partial(dequantize, kinds[hub], weight, scale, name, dtype, chunk_bytes)
            groups.append(OutputGroup(planned, produce, weight.path.name))
            if keep_hub_scales:  # the hub's own scales, under the hub's names
                kept = [PlannedTensor(scale_name(hub), scale.shape, scale.dtype)]
                produce = partial(copy_cast, scale, scale_name(hub), scale.dtype, chunk_bytes)
                groups.append(OutputGroup(kept, produce, scale.path.name, SIDECAR_PREFIX))
        else:
            source = sources[hub]
            produce = partial(copy_cast, source, name, dtype, chunk_bytes)
            groups.append(OutputGroup(planned, produce, source.path.name))
    order = {path.name: i for i, path in enumerate(source_files(sources))}
    groups.sort(key=lambda g: order.get(g.source_shard, 0))
    return groups


def convert_hub_to_native(src: str | Path, dst: str | Path, weight_mode: str = "bf16", keep_hub_scales: bool = True,
                          max_shard_size: str | int | None = None, progress: bool = True,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep_non_finite: bool = False) -> Path:
    """Convert the hub checkpoint in `src` to the native layout in `dst` (atomic; an interrupted run resumes).

    Raises CheckpointError before writing anything when the source is incomplete or does not match its config,
    and NonFiniteWeightError (naming the tensor) on NaN/Inf values (FP8 NaN codes and E8M0 0xFF scales
    included) unless `keep_non_finite`."""
    if weight_mode not in ("bf16", "quantized"):
        raise ValueError(f"weight_mode must be 'bf16' or 'quantized', got {weight_mode!r}")
    src, dst = Path(src), Path(dst)
    config = load_config(src)
    keep_hub_scales = keep_hub_scales and weight_mode == "bf16"
    groups = build_groups(src, config, weight_mode, keep_hub_scales, chunk_bytes)
    shards = plan_shards(groups, parse_size(max_shard_size))
    native = with_weight_mode(config, weight_mode)
    files = sorted({g.source_shard for g in groups})

    def finalize(folder: Path) -> None:
        write_index(folder, shards, "model")
        if keep_hub_scales:
            write_index(folder, shards, SIDECAR_PREFIX)
        copy_auxiliary_files(src, folder)
        write_native_config(folder, native)

    fingerprint = plan_fingerprint(shards, ["hub_to_native", weight_mode, keep_hub_scales, keep_non_finite,
                                            source_identity([src / f for f in files])])
    return write_shards(dst, shards, finalize, fingerprint, progress, f"hub -> native ({weight_mode})",
                        keep_non_finite)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""

    def add_arguments(parser) -> None:
        parser.add_argument("--weight-mode", choices=("bf16", "quantized"), default="bf16",
                            help="bf16: dequantize every quantized weight exactly (default); quantized: keep the "
                                 "FP8/FP4 bytes and scales")
        parser.add_argument("--no-hub-scales", action="store_true",
                            help="bf16 mode: do not keep the hub's scales next to the weights (the way back to the "
                                 "hub then re-derives scales and is value-exact, not byte-exact)")

    def convert(args) -> Path:
        return convert_hub_to_native(args.src, args.dst, args.weight_mode, not args.no_hub_scales,
                                     args.max_shard_size, not args.quiet, keep_non_finite=args.keep_non_finite)

    return run_cli(__doc__, add_arguments, convert, argv)


if __name__ == "__main__":
    raise SystemExit(main())
