"""Interleaved-pair rotary embedding on the last `rope_dim` dims, with the reference's YaRN frequency ramp."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..kernels.rope import apply_rope, apply_rope_tail  # noqa: F401  (the layers' import point)


def rope_inv_freq(rope_dim: int, theta: float, yarn_factor: float = 1.0, yarn_original_len: int = 0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """fp32 frequencies of the rope_dim/2 pairs. YaRN (when yarn_original_len > 0) divides the low-frequency
    pairs by `yarn_factor` with a linear ramp between; no attention-scale factor is applied anywhere."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn_original_len > 0:
        def pair_index(rotations: float) -> float:
            return rope_dim * math.log(yarn_original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair_index(beta_fast)), 0)
        high = min(math.ceil(pair_index(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / yarn_factor * (1 - keep) + freqs * keep
    return freqs


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Unit complex rotations [*positions.shape, rope_dim/2] (complex64) for integer positions."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    return torch.polar(torch.ones_like(angles), angles)


class DeepseekV41Rotary:
    """The RoPE frequencies of every (theta, yarn) variant the layers use, built once per device: a step then copies
    nothing from the host (which a CUDA graph could not capture)."""

    def __init__(self, text_config, variants: Iterable[tuple[float, bool]]) -> None:
        scaling = text_config.rope_scaling or {}
        self.rope_dim = text_config.qk_rope_head_dim
        self.yarn = (text_config.yarn_factor, text_config.yarn_original_max_position_embeddings,
                     float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1)))
        self.variants = tuple(dict.fromkeys(variants))
        self._inv_freq: dict[tuple[float, bool, torch.device], torch.Tensor] = {}

    def inv_freq(self, theta: float, yarn: bool, device: torch.device) -> torch.Tensor:
        key = (theta, yarn, device)
        if key not in self._inv_freq:
            factor, original, beta_fast, beta_slow = self.yarn
            self._inv_freq[key] = rope_inv_freq(self.rope_dim, theta, factor if yarn else 1.0,
                                                original if yarn else 0, beta_fast, beta_slow).to(device)
        return self._inv_freq[key]

    def rotations(self, positions: torch.Tensor) -> dict[tuple[float, bool], tuple[torch.Tensor, torch.Tensor]]:
        """(theta, yarn) -> (rotations at `positions` (-1 is treated as 0), inv_freq) for every variant."""
        rotations = {}
        for theta, yarn in self.variants:
            inv_freq = self.inv_freq(theta, yarn, positions.device)
            rotations[(theta, yarn)] = (rope_angles(positions.clamp_min(0), inv_freq), inv_freq)
        return rotations

    def angles(self, spec, positions: torch.Tensor) -> torch.Tensor:
        """The rotations of layer `spec`'s variant at `positions`."""
        return rope_angles(positions, self.inv_freq(spec.rope_theta, spec.use_yarn, positions.device))
