"""transformers 5.24.0's own ImageProcessingTestMixin and ProcessorTesterMixin, run against this model's processors.

The mixins come from transformers' source distribution through `transformers_tests` (fetched once, cached); the
tests that do not apply are listed, with reasons, in `transformers_tests.SKIPPED`.
"""

import json
import unittest

import numpy as np
import torch
from transformers import AutoTokenizer

import modeling_deepseek_v41  # noqa: F401  registers the config, so AutoImageProcessor/AutoProcessor know the model
from processing import DeepseekV41ImageProcessor, DeepseekV41Processor, plan_image
from repo_paths import FIXTURES
from transformers_tests import load_transformers_tests, skip_inapplicable

image_common = load_transformers_tests("test_image_processing_common")
processing_common = load_transformers_tests("test_processing_common")

CHECKPOINT = FIXTURES / "tiny-vision" / "checkpoint"
CONFIG = json.loads((CHECKPOINT / "config.json").read_text())
VISION = CONFIG["vision_config"]


class DeepseekV41ImageProcessingTester(image_common.ImageProcessingTester):
    """The tiny-vision settings (64-token spans) keep the mixin's 7 random images fast. `min_pixels` is left at its
    default: the mixin reads a `min_pixels` setting back from `size["shortest_edge"]` (Qwen's layout), which this
    processor does not have (its sizes come from the tiling plan)."""

    def __init__(self, parent, **kwargs):
        kwargs.setdefault("patch_size", VISION["patch_size"])
        kwargs.setdefault("downsample_ratio", VISION["downsample_ratio"])
        kwargs.setdefault("max_image_tokens", VISION["max_image_tokens"])
        kwargs.setdefault("do_rescale", True)
        kwargs.setdefault("rescale_factor", 1 / 255)
        kwargs.setdefault("do_normalize", True)
        kwargs.setdefault("image_mean", [0.5, 0.5, 0.5])
        kwargs.setdefault("image_std", [0.5, 0.5, 0.5])
        kwargs.setdefault("do_convert_rgb", True)
        super().__init__(parent, **kwargs)

    def _get_image_processing_classes(self):
        return {"pil": DeepseekV41ImageProcessor}

    def expected_patches(self, images) -> int:
        """Rows of pixel_values for these images: the sum of their planned ViT grids."""
        total = 0
        for image in images:
            if isinstance(image, np.ndarray):
                height, width = image.shape[:2]
            elif isinstance(image, torch.Tensor):
                height, width = image.shape[1:]
            else:
                width, height = image.size
            plan = plan_image(width, height, patch_size=self.patch_size, downsample_ratio=self.downsample_ratio,
                              min_pixels=DeepseekV41ImageProcessor.min_pixels, max_image_tokens=self.max_image_tokens)
            total += plan.n_vit_h * plan.n_vit_w
        return total


@skip_inapplicable("ImageProcessingTestMixin")
class DeepseekV41ImageProcessingTest(image_common.ImageProcessingTestMixin, unittest.TestCase):
    image_processor_tester_class = DeepseekV41ImageProcessingTester

    # pixel_values are [patches of all images, 3, p, p], not [images, 3, H, W]: the mixin's three call tests,
    # checked against the planned grids instead (as transformers' own Qwen2-VL tests do)
    def _check_call(self, **prepare_kwargs):
        tester = self.image_processor_tester
        processor = DeepseekV41ImageProcessor(**self.image_processor_dict)
        images = tester.prepare_image_inputs(equal_resolution=False, **prepare_kwargs)
        p = tester.patch_size
        for batch in (images[:1], images):
            out = processor(batch if len(batch) > 1 else batch[0], return_tensors="pt")
            self.assertEqual(tuple(out.pixel_values.shape), (tester.expected_patches(batch), 3, p, p))
            self.assertEqual(tuple(out.image_grids.shape), (len(batch), 4))

    def test_call_pil(self):
        self._check_call()

    def test_call_numpy(self):
        self._check_call(numpify=True)

    def test_call_pytorch(self):
        self._check_call(torchify=True)


@skip_inapplicable("ProcessorTesterMixin")
class DeepseekV41ProcessorTest(processing_common.ProcessorTesterMixin, unittest.TestCase):
    processor_class = DeepseekV41Processor

    @classmethod
    def _setup_tokenizer(cls):
        return AutoTokenizer.from_pretrained(CHECKPOINT)

    @classmethod
    def _setup_image_processor(cls):
        return DeepseekV41ImageProcessor.from_vision_config(VISION)

    @staticmethod
    def prepare_processor_dict():
        return {"image_token_id": CONFIG["image_token_id"]}

    def test_chat_template_with_image_urls(self):
        """The mixin's test_apply_chat_template_image checks, with one pixel_values row per ViT patch."""
        processor = self.get_processor()
        url = processing_common.MODALITY_INPUT_DATA["images"][0]
        messages = [
            {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
            {"role": "user", "content": [{"type": "text", "text": "Describe this."}, {"type": "image", "url": url}]},
        ]
        out = processor.apply_chat_template([messages, messages], add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt")
        grids = out["image_grids"]
        self.assertEqual(tuple(grids.shape), (2, 4))
        self.assertEqual(out["pixel_values"].shape[0], int((grids[:, 0] * grids[:, 1]).sum()))
        self.assertEqual(out["input_ids"].shape[0], 2)
        for key in ("input_ids", "attention_mask", "token_types", "pixel_values", "image_grids"):
            self.assertIsInstance(out[key], torch.Tensor)
        spans = sum(int(h) * (int(w) + 1) + 2 for h, w in grids[:, 2:].tolist())
        self.assertEqual(int((out["token_types"] >= 0).sum()), spans)
        prompt = processor.apply_chat_template(
            [messages + [{"role": "assistant", "content": [{"type": "text", "text": "It is the sound of"}]}]],
            continue_final_message=True, tokenize=False,
        )
        self.assertTrue(prompt[0].endswith("It is the sound of"))
