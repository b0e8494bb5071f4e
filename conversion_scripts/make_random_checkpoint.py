"""Write a random-weight DeepSeek-V4.1 checkpoint in the exact hub layout, for tests and benchmarks.

    python -m conversion_scripts.make_random_checkpoint --out DIR [--preset tiny|small] [--seed N]
        [--vision/--no-vision] [--max-shard-size 2MB] [--set key=value ...]

The folder holds config.json (the hub's wrapper with text_config, vision_config and quantization_config), sharded
model-0000i-of-0000n.safetensors with model.safetensors.index.json, a tiny byte-level BPE tokenizer whose size is
the config's vocab_size, and generation_config.json. Weights are seeded and stored as the hub stores them.
`--set` overrides text_config keys (values are JSON, e.g. --set hidden_size=256 --set engram_layer_ids=[1,2]).
Exit codes: 0 done, 1 failed (for example an inconsistent config), 2 bad arguments, 4 destination exists.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .layout import HUB_QUANTIZATION_CONFIG, quantized_weight_kinds, scale_name
from .presets import PRESETS, engram_table_rows
from .random_weights import random_tensors
from .safetensors_io import PlannedTensor
from .streaming import DestinationExistsError, OutputGroup, parse_size, plan_fingerprint, plan_shards, \
    write_index, write_shards
from .tiny_tokenizer import TinyTokenizerIds, save_tiny_tokenizer

DEFAULT_MAX_SHARD_SIZE = "2MB"


def hub_config_dict(text: dict, vision: dict | None, image_token_id: int) -> dict:
    """config.json in the hub's wrapper form."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": image_token_id,
        "bos_token_id": 0, "eos_token_id": 1, "dtype": "bfloat16", "tie_word_embeddings": False,
        "quantization_config": copy.deepcopy(HUB_QUANTIZATION_CONFIG),
        "text_config": {"model_type": "deepseek_v41_text", **text},
        "vision_config": None if vision is None else {"model_type": "deepseek_v41_vision", **vision},
    }


def _complete_text_config(text: dict, ids: TinyTokenizerIds, tokenizer_dir: Path) -> dict:
    """Fill in what the tokenizer and the Engram primes decide: noise token, compressed vocab, table rows."""
    from transformers import PreTrainedTokenizerFast

    from modeling_deepseek_v41.layers.engram_hashing import build_compressed_token_map

    text = dict(text)
    text.setdefault("dspark_noise_token_id", ids.noise_token_id)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    text.setdefault("engram_compressed_vocab_size", build_compressed_token_map(tokenizer)[1])
    text.setdefault("engram_num_embeddings", engram_table_rows(
        text["engram_layer_ids"], text["engram_max_ngram_size"], text["engram_vocab_size"], text["engram_n_heads"]))
    return text


def _groups(config, seed: int) -> list[OutputGroup]:
    from modeling_deepseek_v41.model.checkpoint import expected_tensors

    expected = expected_tensors(config, hub_layout=True)
    kinds = quantized_weight_kinds(config)
    scales = {scale_name(n) for n in kinds}
    head_dim = config.text_config.index_head_dim
    groups = []
    for name, (shape, dtype) in expected.items():
        if name in scales:
            continue
        planned = [PlannedTensor(name, shape, dtype)]
        kind = kinds.get(name)
        if kind is not None:
            planned.append(PlannedTensor(scale_name(name), *expected[scale_name(name)]))

        def produce(n=name, s=shape, d=dtype, k=kind):
            tensors = random_tensors(n, s, d, k, seed, scale_name(n) if k else None, head_dim)
            return iter([(key, 0, value) for key, value in tensors.items()])

        groups.append(OutputGroup(planned, produce))
    return groups


def make_random_checkpoint(out_dir: str | Path, text_config_overrides: dict | None = None, vision: bool = False,
                           seed: int = 0, preset: str = "tiny",
                           max_shard_size: str | int | None = DEFAULT_MAX_SHARD_SIZE,
                           vision_config_overrides: dict | None = None, tokenizer_text: str | None = None,
                           progress: bool = False) -> Path:
    """Write a random checkpoint in the hub layout to `out_dir` (which must not exist) and return its path.

    `preset` picks the base text/vision configs ("tiny" mirrors the tiny-text reference fixture, "small" is a bit
    wider); `text_config_overrides` and `vision_config_overrides` replace keys. The folder is written to a temporary
    sibling and renamed into place, so it either exists complete or not at all.
    """
    from modeling_deepseek_v41 import DeepseekV41Config

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise DestinationExistsError(f"{out_dir} already exists; choose another destination or remove it.")
    base_text, base_vision = PRESETS[preset]
    text = {**base_text, **(text_config_overrides or {})}
    vision_config = {**base_vision, **(vision_config_overrides or {})} if vision else None
    with tempfile.TemporaryDirectory(prefix="tiny-tokenizer-") as tokenizer_tmp:
        tokenizer_dir = Path(tokenizer_tmp)
        ids = save_tiny_tokenizer(tokenizer_dir, text["vocab_size"], tokenizer_text, seed)
        text = _complete_text_config(text, ids, tokenizer_dir)
        config_dict = hub_config_dict(text, vision_config, ids.image_token_id)
        config = DeepseekV41Config(**copy.deepcopy(config_dict))  # validates the layer schedule
        shards = plan_shards(_groups(config, seed), parse_size(max_shard_size))

        def finalize(folder: Path) -> None:
            write_index(folder, shards, "model")
            (folder / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
            generation = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False}
            (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            for path in tokenizer_dir.iterdir():
                shutil.copy2(path, folder / path.name)

        fingerprint = plan_fingerprint(shards, ["random", seed, config_dict, tokenizer_text])
        return write_shards(out_dir, shards, finalize, fingerprint, progress, "random checkpoint")


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    summary, _, details = __doc__.strip().partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details.strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="base config (default tiny)")
    parser.add_argument("--seed", type=int, default=0, help="weight and tokenizer seed (default 0)")
    parser.add_argument("--vision", action=argparse.BooleanOptionalAction, default=False,
                        help="include the vision tower (default: text only)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, type=parse_size,
                        help=f"split weight files at this size (default {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--set", dest="overrides", action="append", type=_parse_override, default=[],
                        metavar="KEY=VALUE", help="override a text_config key (JSON value); repeatable")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        out = make_random_checkpoint(args.out, dict(args.overrides), args.vision, args.seed, args.preset,
                                     args.max_shard_size, progress=not args.quiet)
    except DestinationExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 4
    except (OSError, RuntimeError, ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
