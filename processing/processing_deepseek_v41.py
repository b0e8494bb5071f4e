"""DeepSeek-V4.1 processor: tokenizer + image processor, expanding each image placeholder into its image span."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin
from transformers.utils import cached_file, logging

from .image_processing_deepseek_v41 import (
    TOKEN_TYPE_TEXT,
    DeepseekV41ImageProcessor,
    span_token_types,
)

logger = logging.get_logger(__name__)

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
DEFAULT_CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text(encoding="utf-8")
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


class DeepseekV41Processor(ProcessorMixin):
    """Prepares DeepSeek-V4.1 prompts with images.

    Every `<｜deepseek_image｜>` placeholder token in the text is replaced by the span
    `[START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]` of the matching image (in order); all span
    positions carry the image token id, and `token_types` says which is which (-1 text, 0 start, 1 image,
    2 newline, 3 end).

    Output (`BatchFeature`): `input_ids`, `attention_mask`, `token_types` (lists, or tensors with
    `return_tensors`; rows of different lengths are padded on the tokenizer's padding side with the pad id,
    mask 0 and type -1), and when images are given `pixel_values` (bf16 `[sum of n_vit_h*n_vit_w, 3, p, p]`)
    and `image_grids` (int64 `[n_images, 4]` = n_vit_h, n_vit_w, n_llm_h, n_llm_w), always torch tensors.
    """

    model_input_names = ["input_ids", "attention_mask", "token_types", "pixel_values", "image_grids"]

    def __init__(
        self,
        image_processor: DeepseekV41ImageProcessor | None = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        image_token: str = IMAGE_PLACEHOLDER,
        image_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        if image_processor is None:
            image_processor = DeepseekV41ImageProcessor()
        if tokenizer is None:
            raise ValueError("DeepseekV41Processor needs a tokenizer.")
        super().__init__(image_processor, tokenizer, chat_template=chat_template or DEFAULT_CHAT_TEMPLATE, **kwargs)
        self.image_token = image_token
        self.image_token_id = self._resolve_image_token_id(image_token_id)

    def _resolve_image_token_id(self, configured_id: int | None) -> int | None:
        """The config's id wins; the tokenizer's id for the placeholder spelling must then agree with it."""
        known_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        if known_id is not None and known_id == self.tokenizer.unk_token_id:
            known_id = None
        if configured_id is None:
            return known_id
        if known_id is not None and known_id != configured_id:
            raise ValueError(
                f"The tokenizer maps {self.image_token} to id {known_id} but the model config says image_token_id is "
                f"{configured_id}."
            )
        return configured_id

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> DeepseekV41Processor:
        """Load from a saved processor or from a hub-layout folder (config.json with vision_config + tokenizer)."""
        processor = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        config = _read_model_config(pretrained_model_name_or_path, kwargs)
        if config is not None and config.get("image_token_id") is not None:
            processor.image_token_id = processor._resolve_image_token_id(int(config["image_token_id"]))
        return processor

    @classmethod
    def _get_arguments_from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, processor_dict: dict | None = None, **kwargs: Any
    ) -> list[Any]:
        from transformers import AutoTokenizer

        processor_dict = processor_dict or {}
        saved = processor_dict.get("image_processor")
        if isinstance(saved, dict):
            image_processor = DeepseekV41ImageProcessor(
                **{k: v for k, v in saved.items() if k != "image_processor_type"}
            )
        else:
            hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
            image_processor = DeepseekV41ImageProcessor.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return [image_processor, tokenizer]

    def __call__(
        self,
        images: Any = None,
        text: str | list[str] | None = None,
        videos: Any = None,
        audio: Any = None,
        *,
        add_special_tokens: bool = True,
        padding: bool | str = False,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """Tokenize `text` (one string or a batch) and expand its image placeholders with `images`.

        `images` is a flat list in prompt order (across the batch) or one list per text. The number of
        images must equal the number of placeholders; this is checked before any image is decoded.
        """
        if videos is not None or audio is not None:
            raise ValueError("DeepSeek-V4.1 takes text and images only (no videos or audio).")
        if text is None:
            raise ValueError("DeepseekV41Processor needs `text` (use the image processor alone for images only).")
        for key in ("truncation", "max_length"):
            if kwargs.pop(key, None):
                raise ValueError(f"`{key}` is not supported: truncating a prompt could cut an image span.")
        if kwargs:
            logger.warning_once(f"DeepseekV41Processor ignores the arguments {sorted(kwargs)}.")

        texts = [text] if isinstance(text, str) else list(text)
        token_rows = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        image_list = _flat_images(images)
        placeholders = [sum(1 for t in row if t == self.image_token_id) for row in token_rows]
        if sum(placeholders) != len(image_list):
            raise ValueError(
                f"The text has {sum(placeholders)} image placeholder(s) {self.image_token} "
                f"(per sample: {placeholders}) but {len(image_list)} image(s) were given."
            )
        nested = isinstance(images, (list, tuple)) and all(isinstance(item, (list, tuple)) for item in images)
        if nested and len(texts) > 1 and len(images) == len(texts):
            per_sample = [len(item) for item in images]
            if per_sample != placeholders:
                raise ValueError(f"Images per sample {per_sample} do not match placeholders per sample {placeholders}.")

        image_features: dict[str, torch.Tensor] = {}
        grids: list[list[int]] = []
        if image_list:
            image_features = dict(self.image_processor(image_list))
            grids = image_features["image_grids"].tolist()

        rows_ids, rows_types = [], []
        grid_iter = iter(grids)
        for row in token_rows:
            ids, types = [], []
            for token in row:
                if token != self.image_token_id:
                    ids.append(token)
                    types.append(TOKEN_TYPE_TEXT)
                    continue
                _, _, n_llm_h, n_llm_w = next(grid_iter)
                span = span_token_types(n_llm_h, n_llm_w)
                ids.extend([token] * len(span))
                types.extend(span)
            rows_ids.append(ids)
            rows_types.append(types)

        data = self._pad(rows_ids, rows_types, padding=bool(padding) or return_tensors is not None)
        if return_tensors is not None:
            data = BatchFeature(data, tensor_type=return_tensors)
        data = BatchFeature({**data, **image_features})
        return data

    def _pad(self, rows_ids: list[list[int]], rows_types: list[list[int]], padding: bool) -> dict[str, list]:
        masks = [[1] * len(row) for row in rows_ids]
        longest = max(len(row) for row in rows_ids)
        if padding and any(len(row) != longest for row in rows_ids):
            pad_id = self.tokenizer.pad_token_id
            if pad_id is None:
                raise ValueError("Padding rows of different lengths needs a tokenizer with a pad token.")
            left = self.tokenizer.padding_side == "left"
            for ids, types, mask in zip(rows_ids, rows_types, masks):
                fill = longest - len(ids)
                for values, value in ((ids, pad_id), (types, TOKEN_TYPE_TEXT), (mask, 0)):
                    if left:
                        values[0:0] = [value] * fill
                    else:
                        values.extend([value] * fill)
        return {"input_ids": rows_ids, "attention_mask": masks, "token_types": rows_types}

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)


def _flat_images(images: Any) -> list[Any]:
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in _flat_images(item)]
    return [images]


def _read_model_config(path: str | os.PathLike, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
    config_file = cached_file(path, "config.json", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    if config_file is None:
        return None
    with open(config_file, encoding="utf-8") as file:
        return json.load(file)
