"""Image spans in the token embeddings: every image of a batch through the ViT and the aligner (`vision.py`, the
tower beside this file), and the spans of the token sequence overwritten with those features in reading order and
with the learned delimiter vectors."""

from __future__ import annotations

import torch

from .vision import (
    TOKEN_TYPE_IMAGE, TOKEN_TYPE_IMAGE_END, TOKEN_TYPE_IMAGE_NEWLINE, TOKEN_TYPE_IMAGE_START, DeepseekV41VisionAligner,
    DeepseekV41VisionTower,
)


def embed_images(
    tower: DeepseekV41VisionTower,
    aligner: DeepseekV41VisionAligner,
    pixel_values: torch.Tensor,
    image_grids: torch.Tensor,
) -> torch.Tensor:
    """Run every image of a batch through the ViT and the aligner.

    `pixel_values` is the processor's `[sum of n_vit_h*n_vit_w, 3, p, p]`, `image_grids` its `[n_images, 4]`
    rows `(n_vit_h, n_vit_w, n_llm_h, n_llm_w)`. Returns the IMAGE-slot embeddings of all images concatenated in
    prompt order, `[sum of n_llm_h*n_llm_w, text_hidden]`.
    """
    outputs = []
    offset = 0
    for n_vit_h, n_vit_w, _, _ in image_grids.tolist():
        count = n_vit_h * n_vit_w
        features = tower(pixel_values[offset : offset + count], n_vit_h, n_vit_w)
        outputs.append(aligner(features, n_vit_h, n_vit_w))
        offset += count
    if offset != pixel_values.shape[0]:
        raise ValueError(f"image_grids account for {offset} patches but pixel_values has {pixel_values.shape[0]}.")
    if not outputs:  # a text without images (the processor's empty image inputs)
        return pixel_values.new_empty((0, aligner.w2.out_features), dtype=aligner.w2.weight.dtype)
    return torch.cat(outputs, dim=0)


def merge_image_embeddings(
    inputs_embeds: torch.Tensor,
    token_types: torch.Tensor,
    image_embeds: torch.Tensor,
    image_start: torch.Tensor,
    image_newline: torch.Tensor,
    image_end: torch.Tensor,
) -> torch.Tensor:
    """Overwrite the image spans of `inputs_embeds [B, S, D]` (out of place).

    START, NEWLINE and END positions get the learned delimiter vectors; IMAGE positions get the rows of
    `image_embeds` in reading order (batch row, then position).
    """
    n_slots = int((token_types == TOKEN_TYPE_IMAGE).sum())
    if n_slots != image_embeds.shape[0]:
        raise ValueError(
            f"token_types mark {n_slots} image slots but {image_embeds.shape[0]} image embeddings were given."
        )
    dtype = inputs_embeds.dtype
    types = token_types.unsqueeze(-1)
    merged = torch.where(types == TOKEN_TYPE_IMAGE_START, image_start.to(dtype), inputs_embeds)
    merged = torch.where(types == TOKEN_TYPE_IMAGE_NEWLINE, image_newline.to(dtype), merged)
    merged = torch.where(types == TOKEN_TYPE_IMAGE_END, image_end.to(dtype), merged)
    return merged.masked_scatter(types == TOKEN_TYPE_IMAGE, image_embeds.to(dtype))


def embed_image_spans(
    hidden: torch.Tensor,
    token_types: torch.Tensor | None,
    pixel_values: torch.Tensor,
    image_grids: torch.Tensor | None,
    tower: DeepseekV41VisionTower,
    aligner: DeepseekV41VisionAligner,
    delimiters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Token embeddings `hidden [B, S, D]` with every image span overwritten: delimiters by the learned vectors
    `(image_start, image_newline, image_end)`, image slots by the ViT + aligner features in reading order."""
    if token_types is None or image_grids is None:
        raise ValueError("Images need the processor's token_types and image_grids next to pixel_values.")
    image_embeds = embed_images(tower, aligner, pixel_values, image_grids)
    image_start, image_newline, image_end = delimiters
    return merge_image_embeddings(hidden, token_types, image_embeds, image_start, image_newline, image_end)
