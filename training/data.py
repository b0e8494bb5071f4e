"""Offline training data: drawn pictures of coloured shapes with questions and answers, and English/Python text
taken from the documentation that ships inside Python itself (module and function docstrings).

Everything is generated from a seed, so the same seed always gives the same examples, and held-out sets use seeds
the training sets never use.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {
    "red": (215, 35, 35), "green": (40, 160, 60), "blue": (35, 70, 210), "yellow": (235, 200, 30),
    "purple": (130, 50, 170), "orange": (240, 130, 20),
}
MAIN_QUESTION = "What shape is in the picture, and what colour is it?"
# (question, answer template) pairs; the first is the held-out evaluation question
QUESTIONS = (
    (MAIN_QUESTION, "{A} {colour} {shape}."),
    ("What colour is the shape?", "{Colour}."),
    ("What shape is this?", "A {shape}."),
    ("Describe the picture.", "{A} {colour} {shape} on a light background."),
)
IMAGE_SIZE = 126  # 9 x 9 ViT patches -> 3 x 3 image tokens with the default vision config


@dataclass(frozen=True)
class ShapeSample:
    """One picture's content: which shape, which colour, where and how big (in pixels), and the background."""

    shape: str
    colour: str
    centre: tuple[float, float]
    radius: float
    rotation: float
    background: tuple[int, int, int]

    @property
    def answer(self) -> str:
        """The answer to the main question, e.g. 'A red circle.'"""
        return answer_for(self, 0)


def answer_for(sample: ShapeSample, question_index: int) -> str:
    colour = sample.colour
    return QUESTIONS[question_index][1].format(A="An" if colour[0] in "aeiou" else "A", colour=colour,
                                              Colour=colour.capitalize(), shape=sample.shape)


def random_sample(rng: random.Random, shape: str | None = None, colour: str | None = None,
                  size: int = IMAGE_SIZE) -> ShapeSample:
    radius = rng.uniform(0.22, 0.36) * size
    margin = 1.2 * radius + 2
    centre = (rng.uniform(margin, size - margin), rng.uniform(margin, size - margin))
    grey = rng.randint(225, 255)
    background = tuple(min(255, grey + rng.randint(-8, 0)) for _ in range(3))
    return ShapeSample(shape or rng.choice(SHAPES), colour or rng.choice(sorted(COLOURS)), centre, radius,
                       rng.uniform(-0.35, 0.35), background)


def _polygon(centre: tuple[float, float], radii: list[float], rotation: float) -> list[tuple[float, float]]:
    n = len(radii)
    return [(centre[0] + r * math.sin(rotation + 2 * math.pi * i / n), centre[1] - r * math.cos(rotation + 2 * math.pi * i / n))
            for i, r in enumerate(radii)]


def draw_shape(sample: ShapeSample, size: int = IMAGE_SIZE) -> Image.Image:
    """Render `sample` as an RGB picture of size x size pixels."""
    image = Image.new("RGB", (size, size), sample.background)
    draw = ImageDraw.Draw(image)
    (x, y), r, fill = sample.centre, sample.radius, COLOURS[sample.colour]
    if sample.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif sample.shape == "square":
        draw.polygon(_polygon(sample.centre, [r * 1.2] * 4, sample.rotation + math.pi / 4), fill=fill)
    elif sample.shape == "triangle":
        draw.polygon(_polygon(sample.centre, [r * 1.15] * 3, sample.rotation), fill=fill)
    elif sample.shape == "star":
        draw.polygon(_polygon(sample.centre, [r * 1.2, r * 0.5] * 5, sample.rotation), fill=fill)
    else:
        raise ValueError(f"unknown shape {sample.shape!r}")
    return image


def qa_example(sample: ShapeSample, question_index: int = 0) -> dict:
    """A chat example: the user sends the picture and a question, the assistant answers."""
    question = QUESTIONS[question_index][0]
    answer = answer_for(sample, question_index)
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": draw_shape(sample)},
                                                      {"type": "text", "text": question}]}],
            "answer": answer, "sample": sample}


def shape_qa_examples(count: int, seed: int, main_question_share: float = 0.5) -> list[dict]:
    """`count` picture questions; shapes and colours cycle so every pair appears equally often."""
    rng = random.Random(seed)
    pairs = [(s, c) for s in SHAPES for c in sorted(COLOURS)]
    examples = []
    for i in range(count):
        if i % len(pairs) == 0:
            rng.shuffle(pairs)
        shape, colour = pairs[i % len(pairs)]
        question = 0 if rng.random() < main_question_share else rng.randrange(1, len(QUESTIONS))
        examples.append(qa_example(random_sample(rng, shape, colour), question))
    return examples


def heldout_questions(count: int = 48, seed: int = 10_000) -> list[dict]:
    """The fixed held-out evaluation set: the main question about `count` new pictures (every shape/colour pair
    twice for the default 48), drawn with a seed the training data never uses."""
    return shape_qa_examples(count, seed, main_question_share=1.0)


def python_doc_text() -> str:
    """English and Python prose from the standard library's own docstrings (no network, no files)."""
    import collections
    import contextlib
    import dataclasses
    import functools
    import inspect
    import io
    import itertools
    import json
    import pathlib
    import re
    import string
    import textwrap

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen of Python
        import this
    parts = [this.s.translate(str.maketrans(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
        "NOPQRSTUVWXYZABCDEFGHIJKLMnopqrstuvwxyzabcdefghijklm"))]
    objects = [collections, functools, itertools, json, pathlib, re, string, textwrap, dataclasses, io,
               str.split, str.join, str.replace, str.strip, dict.get, dict.setdefault, list.sort, list.append,
               sorted, len, print, range, enumerate, zip, map, filter, open, isinstance, functools.partial,
               functools.reduce, itertools.chain, collections.Counter, collections.OrderedDict, json.dumps,
               json.loads, pathlib.Path, textwrap.dedent, re.sub, re.compile]
    for obj in objects:
        doc = getattr(obj, "__doc__", None)
        if doc:
            parts.append(inspect.cleandoc(doc))
    return "\n\n".join(parts)


def text_examples(tokenizer, length: int = 64, stride: int | None = None) -> list[dict]:
    """The Python documentation text cut into windows of `length` tokens (BOS first) for language modelling."""
    stride = stride or length // 2
    ids = tokenizer(python_doc_text(), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return [{"input_ids": [bos] + ids[start:start + length - 1]}
            for start in range(0, max(1, len(ids) - length + 1), stride)]


def tokenizer_training_text() -> str:
    """What the default checkpoint's tokenizer is trained on: the documentation text plus the question/answer
    phrases, so that answers like 'A red circle.' are a few tokens each."""
    phrases = []
    for shape in SHAPES:
        for colour in sorted(COLOURS):
            sample = ShapeSample(shape, colour, (0.0, 0.0), 1.0, 0.0, (255, 255, 255))
            phrases.extend(question + " " + answer_for(sample, i) for i, (question, _) in enumerate(QUESTIONS))
    return python_doc_text() + "\n\n" + "\n\n".join(phrases * 3)
