"""Map-style datasets that build their examples on demand from a seed (nothing is stored on disk)."""

from __future__ import annotations

import random

from torch.utils.data import Dataset

from .data import COLOURS, QUESTIONS, SHAPES, qa_example, random_sample


class ShapeQADataset(Dataset):
    """Item i is a picture question drawn from random.Random((seed, i)): every shape/colour pair equally often,
    the main question with probability `main_question_share`, else one of the other questions."""

    def __init__(self, length: int, seed: int, main_question_share: float = 0.5) -> None:
        self.length, self.seed, self.share = length, seed, main_question_share
        self.pairs = [(s, c) for s in SHAPES for c in sorted(COLOURS)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(index)
        rng = random.Random(self.seed * 1_000_003 + index)
        shape, colour = self.pairs[index % len(self.pairs)]
        question = 0 if rng.random() < self.share else rng.randrange(1, len(QUESTIONS))
        return qa_example(random_sample(rng, shape, colour), question)


class MixedDataset(Dataset):
    """Interleaves picture questions and text windows: every `text_every`-th item is text (cycling)."""

    def __init__(self, qa: Dataset, text: list[dict], text_every: int = 4) -> None:
        self.qa, self.text, self.text_every = qa, text, text_every

    def __len__(self) -> int:
        return len(self.qa) + len(self.qa) // max(self.text_every - 1, 1)

    def __getitem__(self, index: int) -> dict:
        group, slot = divmod(index, self.text_every)
        if slot == self.text_every - 1 and self.text:
            return self.text[group % len(self.text)]
        return self.qa[(group * (self.text_every - 1) + slot) % len(self.qa)]
