"""Decoding image inputs (paths, URLs, base64, bytes, `datasets` image dicts, PIL images) into upright PIL images.

The steps follow `transformers.image_utils.load_image`: the same sources, then `PIL.ImageOps.exif_transpose` so a
photo taken sideways comes out upright. `load_image` itself is not called because its final `convert("RGB")` clips
16-bit pixels (a 16-bit grayscale PNG comes out almost all white) and drops the alpha channel (transparent pixels turn
black); here 16-bit images are scaled to 8 bits first and the RGB conversion is left to the image processor, which uses
transformers' `convert_to_rgb` (transparency composited onto white).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any
from urllib.request import urlopen

import numpy as np
import torch
from PIL import Image, ImageOps

# PIL modes that hold 16-bit (or wider integer) samples
_WIDE_INTEGER_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


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


def _to_8_bit(image: Image.Image) -> Image.Image:
    """16-bit grayscale scaled to 8 bits (65535 -> 255); PIL's own conversion would clip everything above 255."""
    if image.mode not in _WIDE_INTEGER_MODES:
        return image
    values = np.asarray(image).astype(np.float64)
    return Image.fromarray(np.round(np.clip(values, 0, 65535) / 257).astype(np.uint8), mode="L")


def upright_pil_image(image: Image.Image) -> Image.Image:
    """The image with its EXIF orientation applied and 16-bit samples scaled to 8 bits, decoded in full."""
    image.load()
    return _to_8_bit(ImageOps.exif_transpose(image))


def decode_image(image: Any) -> Image.Image | np.ndarray | torch.Tensor:
    """One image input as a PIL image (upright, 8-bit), or the array/tensor unchanged.

    Accepts a PIL image, a path, an http(s) URL, a data URL, a base64 string, encoded bytes, or a `datasets` image
    dict `{"bytes": ..., "path": ...}` (bytes win when both are set). Arrays and tensors are already pixels.
    """
    if isinstance(image, (np.ndarray, torch.Tensor)):
        return image
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            image = image["bytes"]
        elif image.get("path") is not None:
            image = image["path"]
        else:
            raise ValueError(f"an image dict needs 'bytes' or 'path' (as `datasets` stores images), got keys "
                             f"{sorted(image)}")
    if isinstance(image, Image.Image):
        return upright_pil_image(image)
    if isinstance(image, (str, os.PathLike)):
        data = _read_image_source(os.fspath(image))
    elif isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    else:
        raise ValueError(f"unsupported image input of type {type(image).__name__}")
    return upright_pil_image(Image.open(io.BytesIO(data)))
