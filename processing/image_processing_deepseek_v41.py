"""Image processor of DeepSeek-V4.1: the released resize plan, gray padding, [-1, 1] normalization, ViT patches."""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
from dataclasses import dataclass
from typing import Any
from urllib.request import urlopen

import numpy as np
import torch
from PIL import Image, ImageOps
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor
from transformers.processing_utils import ImagesKwargs
from transformers.utils import cached_file

# token types of an image span; text positions are TOKEN_TYPE_TEXT
TOKEN_TYPE_TEXT = -1
TOKEN_TYPE_IMAGE_START = 0
TOKEN_TYPE_IMAGE = 1
TOKEN_TYPE_IMAGE_NEWLINE = 2
TOKEN_TYPE_IMAGE_END = 3

PAD_COLOR = (127, 127, 127)


@dataclass(frozen=True)
class ImagePlan:
    """Where an image of a given size ends up: its resampled pixel size and its ViT and LLM grids."""

    best_h: int
    best_w: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def span_tokens(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Positions of an image span: start, each row's tokens plus a newline, end."""
    return n_llm_h * (n_llm_w + 1) + 2


def span_token_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """Token types of an image span in order: start, (image * n_llm_w, newline) * n_llm_h, end."""
    row = [TOKEN_TYPE_IMAGE] * n_llm_w + [TOKEN_TYPE_IMAGE_NEWLINE]
    return [TOKEN_TYPE_IMAGE_START] + row * n_llm_h + [TOKEN_TYPE_IMAGE_END]


def _llm_grid(best_h: int, best_w: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    return (
        math.ceil((best_h // patch_size) / downsample_ratio),
        math.ceil((best_w // patch_size) / downsample_ratio),
    )


def _shrink_to_budget(
    height: float, width: float, patch_size: int, downsample_ratio: int, max_image_tokens: int
) -> tuple[int, int]:
    """The largest aspect-keeping (best_h, best_w) whose span fits in max_image_tokens.

    Solves h_cells * (w_cells + 1) + 2 = budget for a grid with h_cells / w_cells = height / width. Images too
    thin for even one cell across become a single column (or row) of cells.
    """
    cell = patch_size * downsample_ratio
    aspect = height / width
    max_cols = math.sqrt((max_image_tokens - 2) / aspect + 0.25) - 0.5
    max_rows = max_cols * aspect
    if max_cols < 1.0:
        return (max_image_tokens - 2) // 2 * cell, cell
    if max_rows < 1.0:
        return cell, (max_image_tokens - 3) * cell
    scale = min(math.floor(max_cols) * cell / width, math.floor(max_rows) * cell / height)
    return (
        math.floor(height * scale / patch_size) * patch_size,
        math.floor(width * scale / patch_size) * patch_size,
    )


def plan_image(
    width: int,
    height: int,
    *,
    patch_size: int,
    downsample_ratio: int,
    min_pixels: int,
    max_image_tokens: int,
    max_wh_ratio: float | None = None,
) -> ImagePlan:
    """The released resize plan for an image of `width` x `height` pixels (a pure function of its arguments)."""
    w: float = width
    h: float = height
    if max_wh_ratio is not None and w > h * max_wh_ratio:
        w = h * max_wh_ratio
    if 0 < w * h < min_pixels:
        # small images are scaled up to about min_pixels; the int() truncation is part of the plan
        factor = (min_pixels / (w * h)) ** 0.5
        w, h = int(w * factor), int(h * factor)
    best_w = math.ceil(w / patch_size) * patch_size
    best_h = math.ceil(h / patch_size) * patch_size
    n_llm_h, n_llm_w = _llm_grid(best_h, best_w, patch_size, downsample_ratio)
    if span_length(n_llm_h, n_llm_w) > max_image_tokens:
        best_h, best_w = _shrink_to_budget(h, w, patch_size, downsample_ratio, max_image_tokens)
        n_llm_h, n_llm_w = _llm_grid(best_h, best_w, patch_size, downsample_ratio)
    return ImagePlan(best_h, best_w, best_h // patch_size, best_w // patch_size, n_llm_h, n_llm_w)


def _read_image_source(source: str) -> bytes:
    """The bytes behind a URL, a data URL, a file path or a base64 string."""
    if source.startswith(("http://", "https://")):
        with urlopen(source, timeout=30) as response:
            return response.read()
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise ValueError(f"only base64 data URLs are supported, got a data URL with header {header!r}")
        return base64.b64decode(payload)
    if os.path.isfile(source):
        with open(source, "rb") as file:
            return file.read()
    try:
        return base64.b64decode(source, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{source[:80]!r} is neither an existing file, a URL, nor base64 image data") from None


def load_rgb_image(image: Any) -> Image.Image:
    """Decode one image input (PIL image, path, URL, data URL, base64 string, bytes, HWC uint8 array) to RGB."""
    if isinstance(image, Image.Image):
        image.load()
        return image.convert("RGB")
    if isinstance(image, torch.Tensor):
        image = image.numpy()
        if image.ndim == 3 and image.shape[0] in (1, 3, 4) and image.shape[-1] not in (1, 3, 4):
            image = np.moveaxis(image, 0, -1)  # channels-first tensor
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"array images must be uint8 [H, W, C] pixels, got dtype {image.dtype}")
        return Image.fromarray(image.squeeze(-1) if image.ndim == 3 and image.shape[-1] == 1 else image).convert("RGB")
    if isinstance(image, str):
        data = _read_image_source(image)
    elif isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    else:
        raise ValueError(f"unsupported image input of type {type(image).__name__}")
    with Image.open(io.BytesIO(data)) as decoded:
        return decoded.convert("RGB")


class DeepseekV41ImagesKwargs(ImagesKwargs, total=False):
    patch_size: int
    downsample_ratio: int
    min_pixels: int
    max_image_tokens: int
    max_wh_ratio: float | None


class DeepseekV41ImageProcessor(BaseImageProcessor):
    """Turns images into DeepSeek-ViT patches, following the official preprocessing exactly.

    Each image is planned from its size (see `plan_image`), padded into `(best_w, best_h)` with
    `ImageOps.pad` (aspect kept, centred, bicubic, gray 127 fill; a plain resize when `max_wh_ratio` clips the
    width), normalized to `(x / 255 - 0.5) / 0.5` in bf16 and cut into `[3, p, p]` patches in row-major order.

    Output (`BatchFeature`):
        - `pixel_values`: bf16 `[sum of n_vit_h * n_vit_w, 3, p, p]`, the patches of all images concatenated.
        - `image_grids`: int64 `[n_images, 4]`, per image `(n_vit_h, n_vit_w, n_llm_h, n_llm_w)`.

    Settings are those of the model's `vision_config`; `from_pretrained` falls back to the `vision_config` of
    `config.json` when the folder has no `preprocessor_config.json` (the hub layout).
    """

    model_input_names = ["pixel_values", "image_grids"]
    valid_kwargs = DeepseekV41ImagesKwargs

    def __init__(
        self,
        patch_size: int = 14,
        downsample_ratio: int = 3,
        min_pixels: int = 295936,
        max_image_tokens: int = 1024,
        max_wh_ratio: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if max_image_tokens < 5:
            raise ValueError(f"max_image_tokens must be at least 5 (one cell plus delimiters), got {max_image_tokens}")
        self.patch_size = patch_size
        self.downsample_ratio = downsample_ratio
        self.min_pixels = min_pixels
        self.max_image_tokens = max_image_tokens
        self.max_wh_ratio = max_wh_ratio

    @classmethod
    def from_vision_config(cls, vision_config: Any, **kwargs: Any) -> DeepseekV41ImageProcessor:
        """Settings from a vision config object or dict (the hub's `vision_config` key names)."""
        if not isinstance(vision_config, dict):
            vision_config = vision_config.to_dict()
        names = ("patch_size", "downsample_ratio", "min_pixels", "max_image_tokens", "max_wh_ratio")
        settings = {name: vision_config[name] for name in names if name in vision_config}
        return cls(**{**settings, **kwargs})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any):
        """Load from `preprocessor_config.json`, else a saved processor's `processor_config.json`, else the
        `vision_config` of `config.json` (the hub layout)."""
        hub_kwargs = {
            key: kwargs[key]
            for key in ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
            if key in kwargs
        }

        def find(filename: str) -> str | None:
            return cached_file(
                pretrained_model_name_or_path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs
            )

        if find("preprocessor_config.json") is not None:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        overrides = {k: v for k, v in kwargs.items() if k in cls.valid_kwargs.__annotations__}
        processor_file = find("processor_config.json")
        if processor_file is not None:
            with open(processor_file, encoding="utf-8") as file:
                saved = json.load(file).get("image_processor")
            if isinstance(saved, dict):
                settings = {k: v for k, v in saved.items() if k != "image_processor_type"}
                return cls(**{**settings, **overrides})
        config_file = find("config.json")
        if config_file is None:
            raise OSError(
                f"{pretrained_model_name_or_path} has no preprocessor_config.json, processor_config.json or "
                "config.json; cannot build the DeepSeek-V4.1 image processor."
            )
        with open(config_file, encoding="utf-8") as file:
            vision_config = json.load(file).get("vision_config")
        if not vision_config:
            raise ValueError(f"{config_file} has no vision_config: this checkpoint has no vision tower.")
        return cls.from_vision_config(vision_config, **overrides)

    def plan(self, width: int, height: int) -> ImagePlan:
        """The resize plan of an image of this size under this processor's settings."""
        return plan_image(
            width, height, patch_size=self.patch_size, downsample_ratio=self.downsample_ratio,
            min_pixels=self.min_pixels, max_image_tokens=self.max_image_tokens, max_wh_ratio=self.max_wh_ratio,
        )

    def process_one(self, image: Any) -> tuple[torch.Tensor, ImagePlan]:
        """Patches `[n_vit_h * n_vit_w, 3, p, p]` (bf16) and the plan of one image input."""
        try:
            image = load_rgb_image(image)
        except Exception as error:  # any decoder failure (corrupt data can raise many types) is the input's fault
            raise ValueError(f"Could not decode the image: {error}") from error
        if image.width == 0 or image.height == 0:
            raise ValueError(f"The image is empty ({image.width}x{image.height} pixels); give an image with pixels.")
        plan = self.plan(image.width, image.height)
        size = (plan.best_w, plan.best_h)
        if self.max_wh_ratio is not None and image.width >= self.max_wh_ratio * image.height:
            image = image.resize(size)
        else:
            image = ImageOps.pad(image, size, color=PAD_COLOR)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
        pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16)
        p = self.patch_size
        patches = pixels.reshape(3, plan.n_vit_h, p, plan.n_vit_w, p).permute(1, 3, 0, 2, 4)
        return patches.reshape(plan.n_vit_h * plan.n_vit_w, 3, p, p), plan

    def preprocess(self, images: Any, return_tensors: str | None = None, **kwargs: Any) -> BatchFeature:
        """Process one image or a (possibly nested) list of images, in order.

        Outputs are always torch tensors (bf16 pixels have no numpy dtype); `return_tensors` is accepted for
        API compatibility only.
        """
        flat = list(_flatten_images(images))
        if not flat:
            raise ValueError("No images were given to the image processor.")
        patches, grids = [], []
        for index, image in enumerate(flat):
            try:
                image_patches, plan = self.process_one(image)
            except ValueError as error:
                raise ValueError(f"Image {index}: {error}") from error
            patches.append(image_patches)
            grids.append([plan.n_vit_h, plan.n_vit_w, plan.n_llm_h, plan.n_llm_w])
        data = {"pixel_values": torch.cat(patches), "image_grids": torch.tensor(grids, dtype=torch.int64)}
        # always torch: bf16 has no numpy dtype
        return BatchFeature(data=data)


def _flatten_images(images: Any):
    if isinstance(images, (list, tuple)):
        for item in images:
            yield from _flatten_images(item)
    elif images is not None:
        yield images
