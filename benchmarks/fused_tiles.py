"""Sweeps the tiles of the fused decode/prefill kernels on the calls a released-width model makes (one GPU) and
prints each variant's time beside the committed one's, fastest first, with how far its output moved.

- attention: the stored attention's calls captured from a real forward of the `realwidth.py` model (a one-row
  and a 32-row decode step at a 4K context, a 4K exact prefill; a layer without a pool and one with the top-k
  pool each), replayed from CUDA graphs under each `attention.Tiles` variant of the regime the call takes;
- mhc: `hc_step` (a layer's expand and read) at 1, 32 and 16,384 rows under each tile and projection variant.

A variant that fails to compile is reported as such, never ranked. The chosen tiles are written into
kernels/triton/attention.py and mhc.py by hand; decode variants must keep the committed dots' K chunks (batch
invariance: see `test_a_decode_row_does_not_depend_on_the_call_rows`).

    python benchmarks/fused_tiles.py [--only attention|mhc] [--out DIR]   # writes DIR/fused_tiles.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import modeling_deepseek_v41.kernels.triton as kernels  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402
from modeling_deepseek_v41.kernels.triton import attention, mhc  # noqa: E402
from realwidth import build, prefilled_cache, released_config  # noqa: E402
from triton_kernels import graph_ms  # noqa: E402

ATTENTION_VARIANTS = {  # per regime: changes to its committed Tiles
    "DECODE_TILES": [{}, {"logit_entries": 32}, {"logit_entries": 64}, {"out_chunk": 64}, {"block_heads": 8},
                     {"logit_warps": 4}],
    "WIDE_DECODE_TILES": [{}, {"logit_entries": 16}, {"out_chunk": 32}, {"block_heads": 32}, {"logit_warps": 4}],
    "PREFILL_TILES": [{}, {"output_warps": 4}, {"logit_warps": 8}, {"qk_chunk": 64}, {"qk_chunk": 256},
                      {"out_chunk": 128, "output_warps": 4}, {"logit_entries": 32}],
}
MHC_VARIANTS = [dict(SPLIT_DOT=split, BLOCK_D=bd) for split in (True, False) for bd in (16, 32, 64)] + \
    [dict(SPLIT_DOT=split, PREFILL_BLOCK_ROWS=br, PREFILL_BLOCK_D=bd, PREFILL_WARPS=w) for split in (True, False)
     for br, bd, w in ((64, 64, 4), (64, 32, 4), (128, 32, 8), (64, 64, 8))]
lines: list[str] = []


def log(text: str = "") -> None:
    print(text, flush=True)
    lines.append(text)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):  # the StoredWindow / StoredPool named tuples
        return type(value)(*map(_clone, value))
    return value


def captured_attention_calls(model) -> dict[tuple[str, bool], tuple]:
    """The first stored-attention call of each (regime, has a pool) in a decode step at 1 and 32 rows and a 4K exact
    prefill, arguments cloned."""
    calls: dict[tuple[str, bool], tuple] = {}
    launch = kernels.stored_attention

    def capture(*args):
        rows = args[0].shape[0] * args[0].shape[1]
        regime = "PREFILL_TILES" if rows >= attention.PREFILL_MIN_ROWS else \
            "WIDE_DECODE_TILES" if rows >= attention.WIDE_DECODE_ROWS else "DECODE_TILES"
        calls.setdefault((regime, args[8] is not None), tuple(map(_clone, args)))
        return launch(*args)
    vocab = model.config.text_config.vocab_size
    try:
        with torch.no_grad():
            for batch in (1, 32):
                cache, token = prefilled_cache(model, 4096, batch)
                kernels.stored_attention = capture
                model(token, cache=cache)
                kernels.stored_attention = launch
                del cache
            kernels.stored_attention = capture
            ids = torch.randint(3, vocab, (1, 4096), device="cuda")
            model(ids, cache=DeepseekV41Cache(model.config), prefill_mode="exact", logits_to_keep=1)
    finally:
        kernels.stored_attention = launch
    return calls


def sweep_attention(model) -> None:
    calls = captured_attention_calls(model)
    for regime, variants in ATTENTION_VARIANTS.items():
        committed = getattr(attention, regime)
        mine = {pool: args for (name, pool), args in calls.items() if name == regime}
        reference = {pool: kernels.stored_attention(*args) for pool, args in mine.items()}
        results = []
        try:
            for change in variants:
                setattr(attention, regime, dataclasses.replace(committed, **change))
                try:
                    us = sum(graph_ms([lambda a=args: kernels.stored_attention(*a)]) * 1e3 for args in mine.values())
                    moved = max((kernels.stored_attention(*args).float() - reference[pool].float()).abs().max().item()
                                for pool, args in mine.items())
                    results.append((us, f"{us:10.1f} us  max change {moved:.2e}  {change or 'committed'}"))
                except Exception as error:  # noqa: BLE001 - a tile Triton cannot compile is reported, not ranked
                    log(f"{regime} {change}: failed ({type(error).__name__}: {str(error)[:80]!r})")
        finally:
            setattr(attention, regime, committed)
        log(f"{regime} ({committed}): {len(mine)} captured calls, summed")
        for _, text in sorted(results):
            log("  " + text)


def sweep_mhc() -> None:
    hc, dim = 4, 5120
    for rows in (1, 32, 16384):
        g = torch.Generator(device="cuda").manual_seed(rows)
        streams = torch.randn(rows, hc, dim, device="cuda", generator=g).bfloat16()
        read = torch.rand(rows, hc, device="cuda", generator=g)
        fn = torch.randn(24, hc * dim, device="cuda", generator=g) * (hc * dim) ** -0.5
        scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
        norm = torch.rand(dim, device="cuda").bfloat16() + 0.5
        out = torch.randn(rows, dim, device="cuda", generator=g).bfloat16()
        post, comb = 2 * torch.rand(rows, hc, device="cuda"), torch.rand(rows, hc, hc, device="cuda")
        weights = (streams, read, fn, scale, base, norm, 20, 1e-6, 1e-6, 1e-6)

        def expand():
            return kernels.hc_step(*weights, out, post, comb)

        def read_only():
            return kernels.hc_step(*weights)
        reference = expand()
        prefill = rows > mhc.DECODE_ROWS
        results = []
        for change in MHC_VARIANTS:
            if prefill != ("PREFILL_BLOCK_D" in change):
                continue
            saved = {name: getattr(mhc, name) for name in change}
            try:
                for name, value in change.items():
                    setattr(mhc, name, value)
                us = (graph_ms([expand]) + graph_ms([read_only])) * 1e3
                got = expand()
                moved = ((got[3] - reference[3]).abs().max() / reference[3].abs().max()).item()
                results.append((us, f"{us:10.1f} us  comb rel. change {moved:.1e}  {change}"))
            except Exception as error:  # noqa: BLE001 - reported, not ranked
                log(f"mhc {rows} rows {change}: failed ({type(error).__name__})")
            finally:
                for name, value in saved.items():
                    setattr(mhc, name, value)
        log(f"mHC expand + read, {rows} rows:")
        for _, text in sorted(results):
            log("  " + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--only", choices=("attention", "mhc"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fused_tiles.py needs a CUDA GPU.")
    log(f"device: {torch.cuda.get_device_name()}")
    if args.only != "mhc":
        sweep_attention(build(released_config("quantized", 32, 1 << 20)))
        torch.cuda.empty_cache()
    if args.only != "attention":
        sweep_mhc()
    Path(args.out, "fused_tiles.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
