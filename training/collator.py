"""Batch collation for training: chat examples with pictures (loss on the assistant's answer only) and plain text
examples (loss on every token), padded together into one batch with the processor's model inputs."""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100
TEXT = -1  # token type of text positions


class DeepseekV41TrainingCollator:
    """Turns a list of examples into a `DeepseekV41ForCausalLM` training batch.

    Examples are dicts of one of these forms:
    - `{"messages": [...], "answer": str}`: a chat prompt (content parts may hold images) rendered with the
      processor's chat template and generation prompt, followed by `answer` and the end-of-sentence token; only the
      answer and its end token are labelled.
    - `{"text": str}` or `{"input_ids": [...]}`: plain language-modelling text, every token labelled.

    Returns `input_ids`, `attention_mask`, `token_types`, `labels` (-100 where unlabelled) and, when any example
    has images, `pixel_values` and `image_grids` (as the processor makes them). Rows are right-padded with the pad
    token. With `mask_padding=False` (the default) the fill positions keep attention_mask 1 and are only left out
    of the loss: with a causal model, tokens after a row's end cannot change anything before it, so the loss and
    gradients are those of the unpadded rows, and no query is left without any visible key (a fully masked query
    currently gives NaN gradients to `attn_sink`). `mask_padding=True` writes the usual 0s in attention_mask.
    """

    def __init__(self, processor, max_length: int | None = None, train_on_prompt: bool = False,
                 mask_padding: bool = False) -> None:
        self.processor = processor
        self.mask_padding = mask_padding
        self.tokenizer = processor.tokenizer
        self.max_length = max_length
        self.train_on_prompt = train_on_prompt

    def _chat_row(self, example: dict) -> tuple[list[int], list[int], list[int], list[Any]]:
        messages = example["messages"]
        images = [part["image"] for message in messages if isinstance(message.get("content"), list)
                  for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        encoded = self.processor(text=prompt, images=images or None, add_special_tokens=False)
        ids, types = list(encoded["input_ids"][0]), list(encoded["token_types"][0])
        answer = self.tokenizer(example["answer"], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        prompt_labels = [t if self.train_on_prompt and ty == TEXT else IGNORE_INDEX for t, ty in zip(ids, types)]
        return ids + answer, types + [TEXT] * len(answer), prompt_labels + answer, images

    def _text_row(self, example: dict) -> tuple[list[int], list[int], list[int], list[Any]]:
        ids = example.get("input_ids")
        if ids is None:
            ids = self.tokenizer(example["text"])["input_ids"]
        ids = list(ids)
        return ids, [TEXT] * len(ids), list(ids), []

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        rows = [self._chat_row(e) if "messages" in e else self._text_row(e) for e in examples]
        if self.max_length is not None:
            for ids, types, _, _ in rows:
                if len(ids) > self.max_length and any(t != TEXT for t in types[self.max_length:]):
                    raise ValueError("max_length would cut an image span; raise max_length.")
            rows = [(i[: self.max_length], t[: self.max_length], l[: self.max_length], im) for i, t, l, im in rows]
        longest = max(len(r[0]) for r in rows)
        pad = self.tokenizer.pad_token_id
        batch = {"input_ids": [], "attention_mask": [], "token_types": [], "labels": []}
        images = []
        for ids, types, labels, row_images in rows:
            fill = longest - len(ids)
            batch["input_ids"].append(ids + [pad] * fill)
            batch["attention_mask"].append([1] * len(ids) + [0 if self.mask_padding else 1] * fill)
            batch["token_types"].append(types + [TEXT] * fill)
            batch["labels"].append(labels + [IGNORE_INDEX] * fill)
            images.extend(row_images)
        out = {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
        if images:
            features = self.processor.image_processor(images)
            out["pixel_values"] = features["pixel_values"]
            out["image_grids"] = features["image_grids"]
        return out
