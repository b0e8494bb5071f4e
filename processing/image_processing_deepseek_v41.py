"""Image processor of DeepSeek-V4.1: the released resize plan, gray padding, [-1, 1] normalization, ViT patches."""

import itertools
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import PILImageResampling
from transformers.processing_utils import ImagesKwargs, Unpack
from transformers.utils import cached_file

from .image_loading import decode_image

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


class DeepseekV41ImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    patch_size (`int`, defaults to 14): side of a ViT patch in pixels.
    downsample_ratio (`int`, defaults to 3): ViT patches merged into one LLM position along each side.
    min_pixels (`int`, defaults to 295936): images with fewer pixels are scaled up to about this many.
    max_image_tokens (`int`, defaults to 1024): the longest image span (start, rows of tokens plus a newline, end).
    max_wh_ratio (`float`, *optional*): a width beyond `height * max_wh_ratio` is squeezed (plain resize, no padding).
    """

    patch_size: int
    downsample_ratio: int
    min_pixels: int
    max_image_tokens: int
    max_wh_ratio: float | None


# standard kwargs that have no meaning for the tiling plan: each image's size comes from the plan
_NOT_APPLICABLE = {
    "size": "each image's size is planned from min_pixels and max_image_tokens; set those instead",
    "crop_size": "images are padded into their planned size, never cropped",
    "do_center_crop": "images are padded into their planned size, never cropped",
    "pad_size": "each image is padded (gray, centred) to its own planned size",
    "do_pad": "each image is padded (gray, centred) to its own planned size",
}


class DeepseekV41ImageProcessor(PilBackend):
    """Turns images into DeepSeek-ViT patches, following the official preprocessing exactly.

    Each image is decoded upright (EXIF orientation applied, 16-bit samples scaled to 8 bits, see `image_loading`),
    converted to RGB with transparency composited onto white (transformers' `convert_to_rgb`: a transparent
    background reads as the white page it is usually shown on, where black would invent dark content), planned from
    its size (see `plan_image`), padded into `(best_w, best_h)` with `ImageOps.pad` (aspect kept, centred, `resample`
    = bicubic, gray 127 fill; a plain resize when `max_wh_ratio` clips the width), rescaled by `rescale_factor`,
    normalized with `image_mean`/`image_std` ([-1, 1] by default), cast to bf16 and cut into `[3, p, p]` patches in
    row-major order.

    Output (`BatchFeature`, always torch tensors: bf16 has no numpy dtype):
        - `pixel_values`: bf16 `[sum of n_vit_h * n_vit_w, 3, p, p]`, the patches of all images concatenated.
        - `image_grids`: int64 `[n_images, 4]`, per image `(n_vit_h, n_vit_w, n_llm_h, n_llm_w)`.

    Settings are those of the model's `vision_config`; `from_pretrained` falls back to the `vision_config` of
    `config.json` when the folder has no `preprocessor_config.json` (the hub layout).
    """

    do_convert_rgb = True
    do_resize = True
    resample = PILImageResampling.BICUBIC
    do_rescale = True
    rescale_factor = 1 / 255
    do_normalize = True
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    patch_size = 14
    downsample_ratio = 3
    min_pixels = 295936
    max_image_tokens = 1024
    max_wh_ratio = None
    valid_kwargs = DeepseekV41ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grids"]

    def __init__(self, **kwargs: Unpack[DeepseekV41ImageProcessorKwargs]) -> None:
        super().__init__(**kwargs)
        self._validate_plan_settings(self.patch_size, self.downsample_ratio, self.min_pixels, self.max_image_tokens,
                                     self.max_wh_ratio)

    @staticmethod
    def _validate_plan_settings(patch_size, downsample_ratio, min_pixels, max_image_tokens, max_wh_ratio) -> None:
        if max_image_tokens < 5:
            raise ValueError(f"max_image_tokens must be at least 5 (one cell plus delimiters), got {max_image_tokens}")
        for name, value in (("patch_size", patch_size), ("downsample_ratio", downsample_ratio)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if min_pixels < 0:
            raise ValueError(f"min_pixels must be >= 0, got {min_pixels}")
        if max_wh_ratio is not None and max_wh_ratio <= 0:
            raise ValueError(f"max_wh_ratio must be positive or None, got {max_wh_ratio}")

    @classmethod
    def from_vision_config(cls, vision_config: Any, **kwargs: Any) -> "DeepseekV41ImageProcessor":
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
                return cls.from_dict({**saved, **overrides})
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

    def fetch_images(self, images: Any) -> Any:
        """Decode every image input (paths, URLs, bytes, `datasets` dicts, PIL images), keeping the nesting; an
        undecodable one is a ValueError naming its position in prompt order."""
        counter = itertools.count()

        def fetch(item: Any) -> Any:
            if isinstance(item, (list, tuple)):
                return [fetch(inner) for inner in item]
            index = next(counter)
            try:
                return decode_image(item)
            except Exception as error:  # any decoder failure (corrupt data can raise many types) is the input's
                raise ValueError(f"Image {index}: Could not decode the image: {error}") from error

        return fetch(images)

    def _prepare_images_structure(self, images: Any, expected_ndims: int = 3) -> list[Any]:
        """One flat list in prompt order, whatever the nesting (a 4-d array or tensor is a batch of images)."""
        flat = []
        for image in flatten_images(self.fetch_images(images)):
            is_batch = isinstance(image, (np.ndarray, torch.Tensor)) and image.ndim == expected_ndims + 1
            flat.extend(list(image) if is_batch else [image])
        return flat

    def _validate_preprocess_kwargs(self, **kwargs: Any) -> None:
        for name, reason in _NOT_APPLICABLE.items():
            if kwargs.get(name):
                raise ValueError(f"`{name}` does not apply to the DeepSeek-V4.1 image processor: {reason}.")
        if kwargs.get("do_resize") is False:
            raise ValueError("do_resize=False is not supported: DeepSeek-ViT needs each image at its planned size.")
        if kwargs.get("do_rescale") and kwargs.get("rescale_factor") is None:
            raise ValueError("`rescale_factor` must be set when `do_rescale` is True.")
        if kwargs.get("do_normalize") and (kwargs.get("image_mean") is None or kwargs.get("image_std") is None):
            raise ValueError("`image_mean` and `image_std` must both be set when `do_normalize` is True.")
        if kwargs.get("return_tensors") not in (None, "pt"):
            raise ValueError(f"return_tensors={kwargs['return_tensors']!r} is not supported: pixel_values are bf16, "
                             "which numpy cannot hold; use 'pt' (or leave it out).")
        self._validate_plan_settings(kwargs["patch_size"], kwargs["downsample_ratio"], kwargs["min_pixels"],
                                     kwargs["max_image_tokens"], kwargs["max_wh_ratio"])

    def _preprocess(
        self,
        images: list[np.ndarray],
        resample: PILImageResampling | int,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: tuple[float, ...],
        image_std: tuple[float, ...],
        patch_size: int,
        downsample_ratio: int,
        min_pixels: int,
        max_image_tokens: int,
        max_wh_ratio: float | None,
        **kwargs: Any,
    ) -> BatchFeature:
        if not images:
            raise ValueError("No images were given to the image processor.")
        patches, grids = [], []
        for index, image in enumerate(images):
            if image.dtype != np.uint8 or image.ndim != 3 or image.shape[0] != 3:
                raise ValueError(
                    f"Image {index}: DeepSeek-ViT takes 8-bit RGB pixels; got an array of dtype {image.dtype} and "
                    f"shape {tuple(image.shape)} (channels first). Pass uint8 images, and keep do_convert_rgb=True "
                    "for grayscale or RGBA input."
                )
            height, width = image.shape[1:]
            if width == 0 or height == 0:
                raise ValueError(f"Image {index}: The image is empty ({width}x{height} pixels); give an image with "
                                 "pixels.")
            plan = plan_image(width, height, patch_size=patch_size, downsample_ratio=downsample_ratio,
                              min_pixels=min_pixels, max_image_tokens=max_image_tokens, max_wh_ratio=max_wh_ratio)
            pil = Image.fromarray(np.ascontiguousarray(np.moveaxis(image, 0, -1)))
            size = (plan.best_w, plan.best_h)
            if max_wh_ratio is not None and width >= max_wh_ratio * height:
                pil = pil.resize(size, resample=resample)
            else:
                pil = ImageOps.pad(pil, size, method=resample, color=PAD_COLOR)
            pixels = torch.from_numpy(np.array(pil)).permute(2, 0, 1)
            if do_rescale:
                # in float64, then float32: equal to the reference's float32 x / 255 for every 8-bit value
                pixels = (pixels.double() * rescale_factor).float()
            else:
                pixels = pixels.float()
            if do_normalize:
                mean = torch.tensor(image_mean, dtype=torch.float32).view(-1, 1, 1)
                std = torch.tensor(image_std, dtype=torch.float32).view(-1, 1, 1)
                pixels = (pixels - mean) / std
            p = patch_size
            cut = pixels.to(torch.bfloat16).reshape(3, plan.n_vit_h, p, plan.n_vit_w, p).permute(1, 3, 0, 2, 4)
            patches.append(cut.reshape(plan.n_vit_h * plan.n_vit_w, 3, p, p))
            grids.append([plan.n_vit_h, plan.n_vit_w, plan.n_llm_h, plan.n_llm_w])
        return BatchFeature(data={"pixel_values": torch.cat(patches),
                                  "image_grids": torch.tensor(grids, dtype=torch.int64)})


def flatten_images(images: Any) -> list[Any]:
    """The images of a possibly nested list (None entries skipped), in order."""
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in flatten_images(item)]
    return [] if images is None else [images]
