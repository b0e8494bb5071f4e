"""The image processor against the reference preprocessing (resize plans, patches, token types)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from processing import DeepseekV41ImageProcessor, plan_image, span_token_types
from repo_paths import FIXTURES

FIXTURE = FIXTURES / "image-processor"
SIZES = json.loads((FIXTURE / "sizes.json").read_text())
META = json.loads((FIXTURE / "meta.json").read_text())
# the fixture uses the reference's flat setting names
SETTINGS = {
    "patch_size": SIZES["settings"]["vision_patch_size"],
    "downsample_ratio": SIZES["settings"]["vision_downsample_ratio"],
    "min_pixels": SIZES["settings"]["vision_min_pixels"],
    "max_image_tokens": SIZES["settings"]["vision_max_n_token"],
    "max_wh_ratio": SIZES["settings"]["vision_max_wh_ratio"],
}


@pytest.mark.parametrize("entry", SIZES["sizes"], ids=lambda e: f"{e['width']}x{e['height']}")
def test_resize_plan(entry):
    plan = plan_image(entry["width"], entry["height"], **SETTINGS)
    got = {key: getattr(plan, key) for key in ("best_h", "best_w", "n_vit_h", "n_vit_w", "n_llm_h", "n_llm_w")}
    got["span_tokens"] = plan.span_tokens
    assert got == {key: entry[key] for key in got}
    assert plan.span_tokens <= SETTINGS["max_image_tokens"]


@pytest.mark.parametrize("index", range(len(META["images"])))
def test_processed_image_is_bit_exact(index):
    image = META["images"][index]
    expected = load_file(FIXTURE / "expected.safetensors")
    out = DeepseekV41ImageProcessor(**SETTINGS)(str(FIXTURE / image["file"]))
    grid = out["image_grids"][0].tolist()
    assert grid == [image["n_vit_h"], image["n_vit_w"], image["n_llm_h"], image["n_llm_w"]]
    assert out["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(out["pixel_values"], expected[f"pixel_values.image{index}"])
    types = torch.tensor(span_token_types(image["n_llm_h"], image["n_llm_w"]))
    assert len(types) == image["span_tokens"]
    assert torch.equal(types, expected[f"token_types.image{index}"])


def test_image_input_kinds_agree():
    path = FIXTURE / META["images"][0]["file"]
    processor = DeepseekV41ImageProcessor(**SETTINGS)
    reference = processor(str(path))["pixel_values"]
    with Image.open(path) as pil:
        pil.load()
        array = np.asarray(pil.convert("RGB"))
        for variant in (pil, path.read_bytes(), array):
            assert torch.equal(processor(variant)["pixel_values"], reference)
    batch = processor([str(path), [str(path)]])
    assert batch["image_grids"].shape == (2, 4)
    assert torch.equal(batch["pixel_values"], torch.cat([reference, reference]))


@pytest.mark.parametrize("bad", [b"definitely not an image", "/no/such/file.png", 12345])
def test_undecodable_image_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="Image 0: Could not decode the image"):
        DeepseekV41ImageProcessor(**SETTINGS)(bad)


def test_max_wh_ratio_clips_and_resizes():
    processor = DeepseekV41ImageProcessor(**{**SETTINGS, "max_wh_ratio": 2.0})
    plan = processor.plan(2000, 500)
    assert plan == plan_image(1000, 500, **{**SETTINGS, "max_wh_ratio": None})
    out = processor(Image.new("RGB", (2000, 500), (10, 200, 30)))
    # a plain resize: no gray padding anywhere
    assert not (out["pixel_values"] == torch.tensor(127 / 255 * 2 - 1, dtype=torch.bfloat16)).any()


def test_settings_from_hub_config(tmp_path):
    vision_config = {"patch_size": 14, "downsample_ratio": 3, "min_pixels": 7056, "max_image_tokens": 64,
                     "max_wh_ratio": None, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "vision_config": vision_config}))
    processor = DeepseekV41ImageProcessor.from_pretrained(tmp_path)
    assert (processor.min_pixels, processor.max_image_tokens) == (7056, 64)

    saved = tmp_path / "saved"
    processor.save_pretrained(saved)
    reloaded = DeepseekV41ImageProcessor.from_pretrained(saved)
    assert reloaded.to_dict() == processor.to_dict()

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "vision_config": None}))
    with pytest.raises(ValueError, match="no vision_config"):
        DeepseekV41ImageProcessor.from_pretrained(tmp_path)


def _encoded(width: int, height: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (40, 160, 220)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("size", [(1, 1), (1, 10000), (10000, 1), (3, 7)])
def test_tiny_and_extreme_images_get_valid_plans(size):
    processor = DeepseekV41ImageProcessor(**SETTINGS)
    out = processor(_encoded(*size, "PNG"))
    n_vit_h, n_vit_w, n_llm_h, n_llm_w = out["image_grids"][0].tolist()
    assert out["pixel_values"].shape[0] == n_vit_h * n_vit_w > 0
    assert n_llm_h * (n_llm_w + 1) + 2 <= SETTINGS["max_image_tokens"]
    assert bool(torch.isfinite(out["pixel_values"].float()).all())


@pytest.mark.parametrize("data", [_encoded(64, 48, "PNG")[:40], _encoded(64, 48, "JPEG")[:120],
                                  bytes(range(256)) * 3, b""])
def test_truncated_and_random_bytes_are_clear_errors(data):
    with pytest.raises(ValueError, match="Image 0: Could not decode the image"):
        DeepseekV41ImageProcessor(**SETTINGS)(data)


def test_random_bytes_fuzz_never_crashes_deep_inside():
    generator = np.random.default_rng(0)
    processor = DeepseekV41ImageProcessor(**SETTINGS)
    valid = _encoded(30, 20, "PNG")
    for trial in range(40):
        data = bytearray(valid)
        for index in generator.integers(0, len(data), size=8):
            data[index] = int(generator.integers(0, 256))
        try:
            out = processor(bytes(data))
        except ValueError as error:
            assert str(error).startswith("Image 0:")
        else:
            assert out["pixel_values"].shape[0] > 0


def test_empty_image_is_a_clear_error():
    with pytest.raises(ValueError, match="The image is empty"):
        DeepseekV41ImageProcessor(**SETTINGS)(Image.new("RGB", (0, 0)))


# issue 19: images decoded as transformers' own loading does (EXIF orientation, 16-bit, transparency)


def _saved(image: Image.Image, fmt: str, **save_kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_kwargs)
    return buffer.getvalue()


def test_16_bit_grayscale_png_is_scaled_not_clipped():
    processor = DeepseekV41ImageProcessor(**SETTINGS)
    levels = np.array([[0, 16384, 32768, 65535]], dtype=np.uint16).repeat(40, axis=0).repeat(10, axis=1)
    sixteen = Image.fromarray(levels)
    assert sixteen.mode == "I;16"
    eight = Image.fromarray(np.round(levels / 257).astype(np.uint8))  # the same picture in 8 bits
    from_png = processor(_saved(sixteen, "PNG"))["pixel_values"]
    assert torch.equal(from_png, processor(eight)["pixel_values"])
    assert float(from_png.float().mean()) < 0.5  # a mid-gray picture, not almost all white


def test_exif_orientation_is_applied():
    processor = DeepseekV41ImageProcessor(**SETTINGS)
    upright = Image.new("RGB", (40, 120), (220, 20, 20))
    upright.paste((20, 20, 220), (0, 60, 40, 120))  # red top half, blue bottom half
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    stored_sideways = upright.rotate(90, expand=True)  # what the camera wrote: 120 x 40
    rotated = processor(_saved(stored_sideways, "JPEG", exif=exif.tobytes(), quality=95))
    reference = processor(_saved(upright, "JPEG", quality=95))
    assert torch.equal(rotated["image_grids"], reference["image_grids"])
    assert rotated["image_grids"][0, 0] > rotated["image_grids"][0, 1]  # taller than wide, as shown
    difference = (rotated["pixel_values"].float() - reference["pixel_values"].float()).abs().mean()
    assert float(difference) < 0.05


def test_transparent_pixels_are_composited_on_white():
    processor = DeepseekV41ImageProcessor(**SETTINGS)
    clear = Image.new("RGBA", (56, 56), (0, 0, 0, 0))  # fully transparent black; square, so no gray padding
    clear.paste((0, 0, 255, 255), (0, 0, 28, 56))  # opaque blue left half
    pixels = processor(_saved(clear, "PNG"))["pixel_values"].float()
    values = {tuple(v) for v in pixels.permute(0, 2, 3, 1).reshape(-1, 3).tolist()}
    assert (1.0, 1.0, 1.0) in values  # white where transparent
    assert (0.0, 0.0, 0.0) not in values and (-1.0, -1.0, -1.0) not in values  # never black
    assert (-1.0, -1.0, 1.0) in values  # the opaque blue kept


def test_undecodable_image_error_names_it():
    processor = DeepseekV41ImageProcessor(**SETTINGS)
    good = _saved(Image.new("RGB", (20, 20)), "PNG")
    with pytest.raises(ValueError, match=r"Image 2: Could not decode the image"):
        processor([good, [good, b"\x89PNG broken"]])
    with pytest.raises(ValueError, match=r"Image 0: .*'bytes' or 'path'"):
        processor({"bytes": None, "path": None})
