"""A pool's writes of a decode-sized step in one launch: the completed rows' FP4 codes and scale bytes (the
compressed KV and the index keys), the tokens' raw projections into the recent ring a crop rebuilds carries from,
and the new carry copied into the buffers a replayed graph reads. The cache's torch path is about twenty-five
launches (scatters of every row, kept or not, since a scatter cannot skip without reading the mask back)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, wait_for_inputs


@triton.jit
def _e4m3_bytes(v):
    """The e4m3 bytes of fp32 values that are e4m3 values (scales of the compressed KV): by integer fields, so the
    interpreter encodes subnormals as the GPU does."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)  # multiples of 2^-9 below 2^-6
    return (((bits >> 24) & 0x80) | tl.where(a >= 0.015625, normal, sub)).to(tl.uint8)


@triton.jit
def _copy_row(src, dst, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst + offs, tl.load(src + offs).to(dst.dtype.element_ty))


@triton.jit
def _pool_step_kernel(rows_ptr, kv_codes_ptr, kv_scales_ptr, key_codes_ptr, key_scales_ptr,
                      pool_kv_codes_ptr, pool_kv_scales_ptr, pool_key_codes_ptr, pool_key_scales_ptr,
                      token_kv_ptr, token_score_ptr, pos_ptr, recent_kv_ptr, recent_score_ptr,
                      carry_kv_ptr, carry_score_ptr, held_kv_ptr, held_score_ptr, G, S, recent_size,
                      stride_pool_kv, stride_pool_kvs, stride_pool_key, stride_pool_keys, stride_token,
                      stride_recent, stride_carry, stride_held,
                      KVW: tl.constexpr, KVS: tl.constexpr, KEYW: tl.constexpr, KEYS: tl.constexpr, HD: tl.constexpr,
                      CARRY: tl.constexpr, RECENT: tl.constexpr, COPY_CARRY: tl.constexpr):
    """Program (b, j): j < G writes completed row j of batch row b (if any); then one program per token s writes
    its raw projections to recent slot position % recent_size (padding: nothing); the last copies the carry."""
    wait_for_inputs()
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j < G:
        row = tl.load(rows_ptr + b * G + j)
        if row >= 0:
            new = b * G + j
            _copy_row(kv_codes_ptr + new * KVW, pool_kv_codes_ptr + b * stride_pool_kv + row * KVW, KVW)
            _copy_row(key_codes_ptr + new * KEYW, pool_key_codes_ptr + b * stride_pool_key + row * KEYW, KEYW)
            scale = tl.load(kv_scales_ptr + new * KVS + tl.arange(0, KVS))
            tl.store(pool_kv_scales_ptr + b * stride_pool_kvs + row * KVS + tl.arange(0, KVS), _e4m3_bytes(scale))
            key_scale = tl.load(key_scales_ptr + new * KEYS + tl.arange(0, KEYS))  # powers of two: the exponent
            tl.store(pool_key_scales_ptr + b * stride_pool_keys + row * KEYS + tl.arange(0, KEYS),
                     ((key_scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8))
    elif j < G + S:
        if RECENT:
            s = j - G
            p = tl.load(pos_ptr + b * S + s)
            if p >= 0:
                slot = p % recent_size
                _copy_row(token_kv_ptr + b * stride_token + s * HD, recent_kv_ptr + b * stride_recent + slot * HD, HD)
                _copy_row(token_score_ptr + b * stride_token + s * HD,
                          recent_score_ptr + b * stride_recent + slot * HD, HD)
    elif COPY_CARRY:
        _copy_row(carry_kv_ptr + b * stride_carry, held_kv_ptr + b * stride_held, CARRY * HD)
        _copy_row(carry_score_ptr + b * stride_carry, held_score_ptr + b * stride_held, CARRY * HD)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def pool_step_write(rows: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], keys: tuple[torch.Tensor, torch.Tensor],
                    pool_kv: tuple[torch.Tensor, torch.Tensor], pool_keys: tuple[torch.Tensor, torch.Tensor],
                    tokens: tuple[torch.Tensor, torch.Tensor] | None, positions: torch.Tensor,
                    recent: tuple[torch.Tensor, torch.Tensor] | None,
                    carry: tuple[torch.Tensor, torch.Tensor] | None,
                    held: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Store a step's pool rows [B,G] (-1: none) with their FP4 codes [B,G,w] and fp32 scales [B,G,s] (kv: E4M3
    values, keys: powers of two) into the pool's byte stores [B,cap,*]; the tokens' raw (kv, score) [B,S,hd] at
    positions [B,S] into the recent stores [B,slots,hd] (ratio > 1); the carry [B,r,hd] copied into `held`."""
    batch, groups = rows.shape
    seq = positions.shape[1]
    kv_codes, kv_scales, key_codes, key_scales = (_rows(t) for t in (*kv, *keys))
    for store in (*pool_kv, *pool_keys) + (recent or ()) + (held or ()):
        if not store.is_contiguous():
            raise ValueError("the pool's stores must be contiguous")
    hd = pool_kv[0].shape[-1] * 2
    token_kv, token_score = (_rows(t) for t in tokens) if tokens is not None else (kv_codes, kv_codes)
    recent_kv, recent_score = recent if recent is not None else (kv_codes, kv_codes)
    carry_kv, carry_score = (_rows(t) for t in carry) if held is not None else (kv_codes, kv_codes)
    held_kv, held_score = held if held is not None else (kv_codes, kv_codes)
    _pool_step_kernel[(batch, groups + seq + 1)](
        _rows(rows), kv_codes, kv_scales, key_codes, key_scales, *pool_kv, *pool_keys, token_kv, token_score,
        _rows(positions), recent_kv, recent_score, carry_kv, carry_score, held_kv, held_score, groups, seq,
        recent_kv.shape[1] if recent is not None else 1, pool_kv[0].stride(0), pool_kv[1].stride(0),
        pool_keys[0].stride(0), pool_keys[1].stride(0), token_kv.stride(0), recent_kv.stride(0),
        carry_kv.stride(0), held_kv.stride(0), KVW=kv_codes.shape[-1], KVS=kv_scales.shape[-1],
        KEYW=key_codes.shape[-1], KEYS=key_scales.shape[-1], HD=hd,
        CARRY=held_kv.shape[1] if held is not None else 1, RECENT=recent is not None and tokens is not None,
        COPY_CARRY=held is not None, num_warps=4, **launch_options())
