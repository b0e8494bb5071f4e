"""Vision warm-up: teach the ViT and the aligner to tell the drawn shapes and colours apart before the language
model is trained on picture questions.

Trained from scratch through the language-model loss alone, the small default learns the colour of a picture (a
mean over the pixels) but not its shape: the answer tokens see the picture only through 9 image tokens and the
gradient that reaches the ViT through the backbone is weak. A short supervised stage, a linear classifier over the
aligner's image tokens, gives the tower features that separate shapes; the classifier is thrown away afterwards,
like the head of any pre-trained vision encoder.
"""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils.data import Dataset

from modeling_deepseek_v41.layers.vision_embedding import embed_images

from .data import COLOURS, SHAPES, draw_shape, random_sample


class ShapeLabelDataset(Dataset):
    """Item i is a random picture drawn from random.Random((seed, i)) with its shape and colour class ids."""

    def __init__(self, length: int, seed: int) -> None:
        self.length, self.seed = length, seed
        self.colours = sorted(COLOURS)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(index)
        sample = random_sample(random.Random(self.seed * 1_000_003 + index))
        return {"image": draw_shape(sample), "shape": SHAPES.index(sample.shape),
                "colour": self.colours.index(sample.colour)}


class ShapeLabelCollator:
    """Pictures through the processor's image processor; labels as tensors."""

    def __init__(self, image_processor) -> None:
        self.image_processor = image_processor

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        features = self.image_processor([e["image"] for e in examples])
        return {"pixel_values": features["pixel_values"], "image_grids": features["image_grids"],
                "shape_labels": torch.tensor([e["shape"] for e in examples]),
                "colour_labels": torch.tensor([e["colour"] for e in examples])}


class VisionClassifier(nn.Module):
    """The model's ViT and aligner (shared, not copied) with a linear shape + colour classifier over the
    concatenated image tokens of each picture. Every picture must give the same number of image tokens."""

    def __init__(self, tower: nn.Module, aligner: nn.Module, image_tokens: int, hidden_size: int) -> None:
        super().__init__()
        self.tower, self.aligner = tower, aligner
        self.image_tokens = image_tokens
        self.head = nn.Linear(image_tokens * hidden_size, len(SHAPES) + len(COLOURS))

    def forward(self, pixel_values: torch.Tensor, image_grids: torch.Tensor, shape_labels: torch.Tensor | None = None,
                colour_labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        tokens = embed_images(self.tower, self.aligner, pixel_values, image_grids)
        logits = self.head(tokens.reshape(image_grids.shape[0], -1).to(self.head.weight.dtype))
        shape_logits, colour_logits = logits.split([len(SHAPES), len(COLOURS)], dim=-1)
        out = {"shape_logits": shape_logits, "colour_logits": colour_logits}
        if shape_labels is not None and colour_labels is not None:
            out["loss"] = (nn.functional.cross_entropy(shape_logits, shape_labels)
                           + nn.functional.cross_entropy(colour_logits, colour_labels))
        return out


def image_tokens_per_picture(image_processor) -> int:
    """How many image tokens the processor gives one of the generated pictures."""
    sample = random_sample(random.Random(0))
    grids = image_processor([draw_shape(sample)])["image_grids"]
    return int(grids[0, 2] * grids[0, 3])


@torch.no_grad()
def classifier_accuracy(classifier: VisionClassifier, collator: ShapeLabelCollator, count: int, seed: int) -> dict:
    """Shape and colour accuracy on `count` fresh pictures."""
    batch = collator([ShapeLabelDataset(count, seed)[i] for i in range(count)])
    out = classifier(batch["pixel_values"], batch["image_grids"])
    return {"shape": float((out["shape_logits"].argmax(-1) == batch["shape_labels"]).float().mean()),
            "colour": float((out["colour_logits"].argmax(-1) == batch["colour_labels"]).float().mean())}


def warm_up_vision(model, image_processor, args, seed: int, heldout: int = 96) -> dict:
    """Train `model`'s vision tower and aligner with a throw-away classifier, using `args` (TrainingArguments).
    Returns the training log and the held-out shape/colour accuracy of the classifier."""
    from transformers import Trainer

    classifier = VisionClassifier(model.model.vision, model.model.aligner, image_tokens_per_picture(image_processor),
                                  model.config.text_config.hidden_size)
    collator = ShapeLabelCollator(image_processor)
    dataset = ShapeLabelDataset(args.max_steps * args.per_device_train_batch_size, seed)
    trainer = Trainer(model=classifier, args=args, train_dataset=dataset, data_collator=collator)
    result = trainer.train()
    classifier.eval()
    accuracy = classifier_accuracy(classifier, collator, heldout, seed + 10_000)
    classifier.train()
    return {"train_loss": result.training_loss, "log": trainer.state.log_history, "heldout_accuracy": accuracy}
