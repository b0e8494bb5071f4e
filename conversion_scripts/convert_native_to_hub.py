"""Convert a checkpoint in the layout `save_pretrained` writes back into the hub layout.

    python -m conversion_scripts.convert_native_to_hub --src NATIVE_DIR --dst OUT_DIR

Dense (bf16) weights are quantized with the numerics module's rules: FP8 e4m3 with E8M0 32x32 tile scales, packed
FP4 routed experts with E8M0 per-32 scales, FP8 Engram rows. Where the source keeps the hub's scales
(`hub_scales-*.safetensors`, written by convert_hub_to_native), every tile those scales represent exactly keeps
them, so an unmodified checkpoint goes back to the hub's exact bytes. Quantized native weights are copied as they
are. fp32-held tensors are stored bf16, `engram_token_map` is dropped, and config.json gets the hub's
`quantization_config`. NaN/Inf weights are refused, naming the tensor, unless `--keep-non-finite` (FP8 would
saturate an Inf silently). An interrupted run resumes: finished shards are reused only if their sha256 still
matches. Exit codes: 0 done, 1 conversion failed (rerun to resume), 2 bad arguments, 3 invalid source checkpoint
(nothing written), 4 destination exists, 5 non-finite weights refused.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from modeling_deepseek_v41.loading.safetensors_file import SafetensorsEntry, safetensors_entries

from .cli import run_cli
from .layout import (
    SIDECAR_PREFIX, CheckpointError, copy_auxiliary_files, inspect_source, load_config, quantized_weight_kinds,
    scale_name, source_files, with_weight_mode, write_hub_config,
)
from .safetensors_io import PlannedTensor
from .streaming import OutputGroup, parse_size, plan_fingerprint, plan_shards, source_identity, write_index, \
    write_shards
from .tensor_ops import DEFAULT_CHUNK_BYTES, copy_cast, quantize


def hub_scale_priors(src: Path, expected: dict) -> dict[str, SafetensorsEntry]:
    """The hub scales kept next to a bf16 native checkpoint, where their shapes still fit (empty when absent)."""
    index = src / f"{SIDECAR_PREFIX}.safetensors.index.json"
    if not index.exists():
        return {}
    priors = {}
    for filename in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        if not (src / filename).exists():
            raise CheckpointError(f"{filename}, listed in {index.name}, is missing from {src}.")
        for name, source in safetensors_entries(src / filename).items():
            if name in expected and (source.shape, source.dtype) == expected[name]:
                priors[name] = source
    return priors


def build_groups(src: Path, config, chunk_bytes: int, keep_non_finite: bool = False) -> list[OutputGroup]:
    """Output groups in source order; validates the source first (raises CheckpointError, naming the problem)."""
    from modeling_deepseek_v41.loading.loader import hub_name
    from modeling_deepseek_v41.model.checkpoint import expected_tensors

    # named as in the model's state dict (save_pretrained) or, by earlier releases, as on the hub
    sources = {hub_name(name): source for name, source in inspect_source(src, config, hub_layout=False).items()}
    hub = with_weight_mode(config, "quantized")
    expected = expected_tensors(hub, hub_layout=True)
    native_quantized = config.checkpoint_quantization is not None
    kinds = {} if native_quantized else quantized_weight_kinds(hub)
    priors = {} if native_quantized else hub_scale_priors(src, expected)
    scales = {scale_name(n) for n in kinds}
    groups = []
    for name, (shape, dtype) in expected.items():
        if name in scales:
            continue  # written together with its weight
        source = sources[name]
        if name in kinds:
            scale = scale_name(name)
            planned = [PlannedTensor(name, shape, dtype), PlannedTensor(scale, *expected[scale])]
            produce = partial(quantize, kinds[name], source, name, scale, priors.get(scale), chunk_bytes,
                              keep_non_finite=keep_non_finite)
        else:
            planned = [PlannedTensor(name, shape, dtype)]
            produce = partial(copy_cast, source, name, dtype, chunk_bytes)
        groups.append(OutputGroup(planned, produce, source.path.name))
    order = {path.name: i for i, path in enumerate(source_files(sources))}
    groups.sort(key=lambda g: order[g.source_shard])
    return groups


def convert_native_to_hub(src: str | Path, dst: str | Path, max_shard_size: str | int | None = None,
                          progress: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                          keep_non_finite: bool = False) -> Path:
    """Convert the native checkpoint in `src` to the hub layout in `dst` (atomic; an interrupted run resumes).

    Raises CheckpointError before writing anything when the source is incomplete or does not match its config,
    and NonFiniteWeightError (naming the tensor) on NaN/Inf weights unless `keep_non_finite`."""
    src, dst = Path(src), Path(dst)
    config = load_config(src)
    groups = build_groups(src, config, chunk_bytes, keep_non_finite)
    shards = plan_shards(groups, parse_size(max_shard_size))
    hub = with_weight_mode(config, "quantized")
    files = sorted({g.source_shard for g in groups})
    sidecars = sorted(p.name for p in src.glob(f"{SIDECAR_PREFIX}*"))

    def finalize(folder: Path) -> None:
        write_index(folder, shards, "model")
        copy_auxiliary_files(src, folder)
        write_hub_config(folder, hub)

    fingerprint = plan_fingerprint(shards, ["native_to_hub", keep_non_finite,
                                            source_identity([src / f for f in files + sidecars])])
    return write_shards(dst, shards, finalize, fingerprint, progress, "native -> hub", keep_non_finite)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""

    def convert(args) -> Path:
        return convert_native_to_hub(args.src, args.dst, args.max_shard_size, not args.quiet,
                                     keep_non_finite=args.keep_non_finite)

    return run_cli(__doc__, lambda parser: None, convert, argv)


if __name__ == "__main__":
    raise SystemExit(main())
