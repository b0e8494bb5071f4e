"""DeepSeek-ViT and the 3x3 aligner that turns its patch features into LLM input embeddings (which
`vision_embedding.py` writes into the image spans of the token sequence).

The numerics follow the official reference (bf16 weights and activations, fp32 norm weights, fp32 RoPE
rotation, torch's SDPA) so that a CPU run reproduces the reference bit for bit. Everything also runs in float64
when the modules are cast with `.to(torch.float64)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.configuration_deepseek_v41 import DeepseekV41VisionConfig
from ..kernels.numerics import compute_dtype, weight_dtype
from .linear import DeepseekV41RMSNorm

# token types of an image span (see processing/): text, then the four kinds of span positions
TOKEN_TYPE_TEXT = -1
TOKEN_TYPE_IMAGE_START = 0
TOKEN_TYPE_IMAGE = 1
TOKEN_TYPE_IMAGE_NEWLINE = 2
TOKEN_TYPE_IMAGE_END = 3


def vision_rope_angles(
    n_rows: int, n_cols: int, rope_dim: int, theta: float, dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[n_rows*n_cols, 1, rope_dim]` of the 2D RoPE; patches in row-major order.

    The first half of the angles follows the patch row, the second half the patch column.
    """
    exponents = torch.arange(0, rope_dim, 2, dtype=dtype, device=device) / rope_dim
    inv_freq = 1.0 / (float(theta) ** exponents)
    rows = torch.arange(n_rows, device=device).repeat_interleave(n_cols).to(dtype)
    cols = torch.arange(n_cols, device=device).repeat(n_rows).to(dtype)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of the last dim by the given angles, in at least fp32."""
    x_f = x.to(compute_dtype(x.dtype))
    first, second = x_f.chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(x.dtype)


class DeepseekV41VisionPatchEmbed(nn.Module):
    """A linear map of each flattened `[3, p, p]` patch (channel, row, column order)."""

    def __init__(self, config: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, dtype=weight_dtype(torch.bfloat16))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1).to(self.proj.weight.dtype))


class DeepseekV41VisionAttention(nn.Module):
    """Full bidirectional multi-head attention over one image's patches, with 2D RoPE on q and k."""

    def __init__(self, config: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, dtype=weight_dtype(torch.bfloat16))
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, dtype=weight_dtype(torch.bfloat16))

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.wqkv(hidden_states).chunk(3, dim=-1))
        q = rotate_half_rope(q, cos, sin)
        k = rotate_half_rope(k, cos, sin)
        # heads first, no batch dim, default 1/sqrt(head_dim) scale: the same SDPA call as the reference,
        # so the CPU kernel choice (and its rounding) is the same
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(attn.transpose(0, 1).reshape(n, -1))


class DeepseekV41VisionMLP(nn.Module):
    """SwiGLU: `w1` yields `[gate | up]`, the product goes through `w2`; no biases."""

    def __init__(self, config: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=weight_dtype(torch.bfloat16))
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=weight_dtype(torch.bfloat16))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(hidden_states).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class DeepseekV41VisionBlock(nn.Module):
    """Pre-norm transformer block of the ViT."""

    def __init__(self, config: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.norm1 = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps, torch.float32)
        self.attn = DeepseekV41VisionAttention(config)
        self.norm2 = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps, torch.float32)
        self.mlp = DeepseekV41VisionMLP(config)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cos, sin)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class DeepseekV41VisionTower(nn.Module):
    """DeepSeek-ViT: patch embedding, pre-norm blocks with 2D RoPE and full attention, final RMSNorm.

    One image at a time: `forward(patches [n_vit_h*n_vit_w, 3, p, p], n_vit_h, n_vit_w)` returns
    `[n_vit_h*n_vit_w, hidden_size]`. State-dict keys match the hub's `vision.*` keys without the prefix.
    """

    def __init__(self, config: DeepseekV41VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_dim = config.hidden_size // config.num_attention_heads // 2
        self.rope_theta = config.rope_theta
        self.patch_embed = DeepseekV41VisionPatchEmbed(config)
        self.blocks = nn.ModuleList(DeepseekV41VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps, torch.float32)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        n_vit_h, n_vit_w = int(n_vit_h), int(n_vit_w)
        if patches.shape[0] != n_vit_h * n_vit_w:
            raise ValueError(
                f"Got {patches.shape[0]} patches for a {n_vit_h}x{n_vit_w} patch grid ({n_vit_h * n_vit_w} expected)."
            )
        hidden_states = self.patch_embed(patches)
        cos, sin = vision_rope_angles(
            n_vit_h, n_vit_w, self.rope_dim, self.rope_theta,
            dtype=compute_dtype(hidden_states.dtype), device=hidden_states.device,
        )
        for block in self.blocks:
            hidden_states = block(hidden_states, cos, sin)
        return self.norm(hidden_states)


class DeepseekV41VisionAligner(nn.Module):
    """Merges each r x r neighbourhood of ViT features (r = downsample_ratio) into one LLM embedding.

    The grid is zero-padded at the bottom and right to multiples of r. The merged feature of a cell is ordered
    channel-major, then kernel row, then kernel column, and goes through `w1` (bias), exact GELU and `w2` (bias).
    """

    def __init__(self, config: DeepseekV41VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.downsample_ratio = config.downsample_ratio
        merged_size = config.hidden_size * config.downsample_ratio**2
        self.w1 = nn.Linear(merged_size, text_hidden_size, dtype=weight_dtype(torch.bfloat16))
        self.w2 = nn.Linear(text_hidden_size, text_hidden_size, dtype=weight_dtype(torch.bfloat16))

    def merge_cells(self, features: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """`[n_vit_h*n_vit_w, C]` -> `[n_llm_h*n_llm_w, C*r*r]`, cells in row-major order."""
        r = self.downsample_ratio
        channels = features.shape[-1]
        grid = features.reshape(n_vit_h, n_vit_w, channels).permute(2, 0, 1)
        grid = F.pad(grid, (0, -n_vit_w % r, 0, -n_vit_h % r))
        _, height, width = grid.shape
        cells = grid.reshape(channels, height // r, r, width // r, r).permute(0, 2, 4, 1, 3)
        # built as [features, cells] and transposed, the same memory layout the reference hands to w1
        return cells.reshape(channels * r * r, (height // r) * (width // r)).t()

    def forward(self, features: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        merged = self.merge_cells(features, int(n_vit_h), int(n_vit_w))
        return self.w2(F.gelu(self.w1(merged)))
