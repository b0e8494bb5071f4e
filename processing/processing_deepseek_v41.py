"""DeepSeek-V4.1 processor: tokenizer + image processor, expanding each image placeholder into its image span."""

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessingKwargs, ProcessorMixin, Unpack
from transformers.utils import cached_file

from .chat_messages import validate_conversations
from .image_processing_deepseek_v41 import (
    TOKEN_TYPE_TEXT,
    DeepseekV41ImageProcessor,
    DeepseekV41ImageProcessorKwargs,
    flatten_images,
    span_length,
    span_token_types,
)

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
DEFAULT_CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text(encoding="utf-8")
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


class DeepseekV41ProcessorKwargs(ProcessingKwargs, total=False):
    images_kwargs: DeepseekV41ImageProcessorKwargs


class DeepseekV41Processor(ProcessorMixin):
    """Prepares DeepSeek-V4.1 prompts with images.

    Every `<｜deepseek_image｜>` placeholder token in the text is replaced by the span
    `[START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]` of the matching image (in order); all span
    positions carry the image token id, and `token_types` says which is which (-1 text, 0 start, 1 image,
    2 newline, 3 end).

    Output (`BatchFeature`): `input_ids`, `attention_mask`, `token_types` (lists, or tensors with
    `return_tensors`; with `padding`, rows are padded on the left by default, since a decoder-only model generates
    after the last position of every row, or on the right with `padding_side="right"` for training; padding has the
    pad id, mask 0 and type -1), `pixel_values` (bf16 `[sum of n_vit_h*n_vit_w, 3, p, p]`) and `image_grids` (int64
    `[n_images, 4]` = n_vit_h, n_vit_w, n_llm_h, n_llm_w), always torch tensors, with no rows for a text without
    images (so that a pipeline can batch a text-only chat with a picture chat).
    """

    model_input_names = ["input_ids", "attention_mask", "token_types", "pixel_values", "image_grids"]
    valid_processor_kwargs = DeepseekV41ProcessorKwargs
    # left padding for generation; a padding_side the tokenizer was explicitly created with takes precedence
    text_kwargs = {"padding_side": "left"}

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
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> "DeepseekV41Processor":
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
        overrides = {k: v for k, v in kwargs.items() if k in DeepseekV41ImageProcessorKwargs.__annotations__}
        saved = processor_dict.get("image_processor")
        if isinstance(saved, dict):
            settings = {k: v for k, v in saved.items() if k != "image_processor_type"}
            image_processor = DeepseekV41ImageProcessor.from_dict({**settings, **overrides})
        else:
            hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
            image_processor = DeepseekV41ImageProcessor.from_pretrained(
                pretrained_model_name_or_path, **hub_kwargs, **overrides
            )
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return [image_processor, tokenizer]

    def __call__(
        self,
        images: Any = None,
        text: str | list[str] | None = None,
        **kwargs: Unpack[DeepseekV41ProcessorKwargs],
    ) -> BatchFeature:
        """Tokenize `text` (one string or a batch) and expand its image placeholders with `images`.

        `images` is a flat list in prompt order (across the batch) or one list per text; each image is a PIL image,
        a path, a URL, base64, encoded bytes, a `datasets` image dict or a uint8 array. The number of images must
        equal the number of placeholders; this is checked before any image is decoded. Text and image options go
        through transformers' processor kwargs (flat, or in `text_kwargs` / `images_kwargs`; the same option in
        both is refused): `padding` (rows are padded on the left by default, as a decoder-only model generates),
        `padding_side`, `truncation` / `max_length` (refused where a cut would split an image span),
        `add_special_tokens` (a text that already starts with BOS does not get a second one), `return_tensors`.
        """
        if kwargs.pop("videos", None) is not None or kwargs.pop("audio", None) is not None:
            raise ValueError("DeepSeek-V4.1 takes text and images only (no videos or audio).")
        if images is not None and self.image_token_id is None:
            raise ValueError(f"The tokenizer has no {self.image_token} token, so images cannot be placed in the text.")
        if text is not None:
            text = self._without_leading_bos(text, kwargs)
        out = super().__call__(images=images, text=text, **kwargs)
        if "input_ids" in out:
            out["token_types"] = self._token_types(out["input_ids"], out.get("image_grids"))
            if "pixel_values" not in out:  # no image: empty image inputs, so text-only and picture rows batch alike
                patch = self.image_processor.patch_size
                out["pixel_values"] = torch.empty((0, 3, patch, patch), dtype=torch.bfloat16)
                out["image_grids"] = torch.empty((0, 4), dtype=torch.int64)
        return out

    def _without_leading_bos(self, text: str | list[str], kwargs: dict[str, Any]) -> str | list[str]:
        """Drop a BOS the text already starts with when the tokenizer will add its own (a rendered chat has one)."""
        add_special_tokens = kwargs.get("text_kwargs", {}).get("add_special_tokens", kwargs.get("add_special_tokens"))
        bos = self.tokenizer.bos_token
        if add_special_tokens is False or bos is None:
            return text
        if self.tokenizer("", add_special_tokens=True)["input_ids"][:1] != [self.tokenizer.bos_token_id]:
            return text
        rows = [text] if isinstance(text, str) else list(text)
        rows = [row[len(bos):] if isinstance(row, str) and row.startswith(bos) else row for row in rows]
        return rows[0] if isinstance(text, str) else rows

    def prepare_inputs_layout(self, images: Any = None, text: Any = None, videos: Any = None, audio: Any = None,
                              **kwargs: Any):
        """Text as a list; images are left undecoded so that their count is checked before any decoding."""
        if isinstance(text, str):
            text = [text]
        return images, (list(text) if text is not None else None), videos, audio

    def validate_inputs(self, images: Any = None, text: Any = None, videos: Any = None, audio: Any = None,
                        **kwargs: Any) -> None:
        """Placeholders and images must match in number (in total and, for one list per text, per sample)."""
        if images is None and text is None:
            raise ValueError("DeepseekV41Processor needs `text` and/or `images`.")
        if text is None:
            return
        if not all(isinstance(sample, str) for sample in text):
            raise ValueError("`text` must be a string or a list of strings.")
        placeholders = [sample.count(self.image_token) for sample in text]
        image_list = flatten_images(images)
        if sum(placeholders) != len(image_list):
            raise ValueError(
                f"The total number of {self.image_token} tokens in the prompts should be the same as the number of "
                f"images passed: the text has {sum(placeholders)} image placeholder(s) (per sample: {placeholders}) "
                f"but {len(image_list)} image(s) were given."
            )
        nested = isinstance(images, (list, tuple)) and all(isinstance(item, (list, tuple)) for item in images)
        if nested and len(text) > 1 and len(images) == len(text):
            per_sample = [len(flatten_images(item)) for item in images]
            if per_sample != placeholders:
                raise ValueError(f"Images per sample {per_sample} do not match placeholders per sample {placeholders}.")

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs: Any) -> str:
        """The placeholder repeated over the image's span: start, rows of tokens plus a newline, end."""
        _, _, n_llm_h, n_llm_w = image_inputs["image_grids"][image_idx].tolist()
        return self.image_token * span_length(n_llm_h, n_llm_w)

    def _process_images(self, images: Any, **kwargs: Any) -> tuple[BatchFeature, list[str]]:
        processed = self.image_processor(images, **kwargs)
        replacements = [self.replace_image_token(processed, index) for index in range(len(processed["image_grids"]))]
        return processed, replacements

    def _token_types(self, input_ids: Any, image_grids: torch.Tensor | None) -> Any:
        """-1 on text (and padding), then each image span's types in order; same container as `input_ids`."""
        rows = input_ids.tolist() if hasattr(input_ids, "tolist") else [list(row) for row in input_ids]
        grids = iter(image_grids.tolist() if image_grids is not None else [])
        types = []
        for row in rows:
            row_types, position = [TOKEN_TYPE_TEXT] * len(row), 0
            while position < len(row):
                if row[position] != self.image_token_id:
                    position += 1
                    continue
                _, _, n_llm_h, n_llm_w = next(grids)
                span = span_token_types(n_llm_h, n_llm_w)
                if row[position : position + len(span)] != [self.image_token_id] * len(span):
                    raise ValueError("An image span was cut (truncation or max_length); raise max_length.")
                row_types[position : position + len(span)] = span
                position += len(span)
            types.append(row_types)
        if isinstance(input_ids, torch.Tensor):
            return torch.tensor(types, dtype=torch.long)
        if isinstance(input_ids, np.ndarray):
            return np.array(types, dtype=np.int64)
        return types

    def _normalize_conversations(self, conversation: Any) -> tuple[list, bool]:
        """transformers' normalization (message objects to dicts, OpenAI image_url blocks), then each message's role
        and content checked: `apply_chat_template` fails with a ValueError naming the message before any work."""
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"A conversation is a non-empty list of messages, got {conversation!r:.80}.")
        conversations, is_batched = super()._normalize_conversations(conversation)
        validate_conversations(conversations, is_batched)
        return conversations, is_batched

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)


def _read_model_config(path: str | os.PathLike, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
    config_file = cached_file(path, "config.json", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    if config_file is None:
        return None
    with open(config_file, encoding="utf-8") as file:
        return json.load(file)
