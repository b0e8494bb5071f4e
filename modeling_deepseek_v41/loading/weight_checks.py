"""The finiteness check of loaded weights and scales: a NaN or Inf in a floating weight, an FP8 e4m3 NaN code or
an E8M0 scale byte 0xFF (NaN) is reported by tensor name right after loading, instead of turning every logit into
NaN later. The last step of the loading pipeline; `from_pretrained(..., check_finite=False)` skips it."""

from __future__ import annotations

import torch

from .loader import hub_name

CHECK_CHUNK = 1 << 26  # elements reduced at once: bounds the temporary mask of one large expert tensor


def invalid_values(tensor: torch.Tensor) -> torch.Tensor:
    """Whether `tensor` holds a value that is not a finite number, as a bool on the tensor's device. One reduction
    pass per chunk (aminmax propagates NaN and keeps Inf; it was ~25x faster than isfinite on bf16 on CPU)."""
    flat = tensor.detach().reshape(-1)
    if tensor.dtype == torch.float8_e8m0fnu:  # 0xFF is the only NaN code and the largest byte
        return torch.stack([part.view(torch.uint8).amax() == 0xFF for part in flat.split(CHECK_CHUNK)]).any()
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # NaN (and e5m2 Inf) codes: the top magnitudes
        top = 0x7F if tensor.dtype == torch.float8_e4m3fn else 0x7C
        return torch.stack([(part.view(torch.uint8) & 0x7F).amax() >= top for part in flat.split(CHECK_CHUNK)]).any()
    return ~torch.stack([torch.stack(torch.aminmax(part)).isfinite().all() for part in flat.split(CHECK_CHUNK)]).all()


def check_finite_weights(model) -> None:
    """Raise ValueError naming the first parameter or buffer that holds a non-finite value (one host read per
    device)."""
    tensors = [(name, t) for name, t in (*model.named_parameters(), *model.named_buffers())
               if t.is_floating_point() and t.device.type != "meta" and t.numel() > 0]
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors:
        by_device.setdefault(tensor.device, []).append((name, invalid_values(tensor)))
    for flags in by_device.values():
        invalid = torch.stack([flag for _, flag in flags]).cpu()
        if bool(invalid.any()):
            name = flags[int(invalid.nonzero()[0])][0]
            tensor = dict(tensors)[name]
            kind = "an E8M0 scale byte 0xFF (NaN)" if tensor.dtype == torch.float8_e8m0fnu else "NaN or Inf values"
            raise ValueError(
                f"The loaded weight {hub_name(name)!r} ({tensor.dtype}, shape {tuple(tensor.shape)}) holds {kind}: the "
                "checkpoint is corrupted or was converted from non-finite weights. Re-download or re-convert it; "
                "pass check_finite=False to from_pretrained to load it anyway."
            )

