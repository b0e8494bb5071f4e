"""A small byte-level BPE tokenizer with DeepSeek-V4.1's special tokens, built offline for test checkpoints.

Layout of the ids (vocab_size V):
- 0, 1, 2: `<｜begin▁of▁sentence｜>`, `<｜end▁of▁sentence｜>`, `<｜▁pad▁｜>`
- 3 .. V-17: the 256 byte symbols and the learned merges
- V-16 .. V-1: added special tokens; `<｜deepseek_image｜>` at V-16, the chat markers right after it,
  `<｜dspark_noise｜>` at V-8, and `<｜place▁holder▁no▁N｜>` fillers in the free slots.
Encoding prepends the BOS token, as the released tokenizer does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from processing import DEFAULT_CHAT_TEMPLATE

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
NOISE_TOKEN = "<｜dspark_noise｜>"
CHAT_TOKENS = ("<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>", "<think>", "</think>")
TAIL_SIZE = 16  # added special tokens at the end of the vocabulary
_BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = 3 + _BYTE_ALPHABET + TAIL_SIZE


@dataclass(frozen=True)
class TinyTokenizerIds:
    """The ids a config needs to point at the tokenizer's special tokens."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    image_token_id: int
    noise_token_id: int


def default_training_text() -> str:
    """English and Python text that ships with every Python: the Zen of Python and a few stdlib docstrings.

    Docstrings can change between Python versions, and so can the merges learned from them."""
    import codecs
    import collections
    import contextlib
    import functools
    import io
    import itertools
    import json as json_module
    import pathlib

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    parts = [codecs.decode(this.s, "rot13")]
    for obj in (collections, functools, itertools, json_module, pathlib, collections.OrderedDict, functools.partial,
                pathlib.Path, json_module.dumps, json_module.loads, str.split, str.join, dict.get, list.sort):
        if obj.__doc__:
            parts.append(obj.__doc__)
    return "\n\n".join(parts)


def _tail_tokens(vocab_size: int) -> dict[int, str]:
    """id -> content of the 16 added special tokens at the end of the vocabulary."""
    start = vocab_size - TAIL_SIZE
    named = {start: IMAGE_TOKEN, vocab_size - 8: NOISE_TOKEN}
    for offset, token in enumerate(CHAT_TOKENS, start=1):
        named[start + offset] = token
    tail, filler = {}, 0
    for token_id in range(start, vocab_size):
        if token_id in named:
            tail[token_id] = named[token_id]
        else:
            tail[token_id] = f"<｜place▁holder▁no▁{filler}｜>"
            filler += 1
    return tail


def build_tiny_tokenizer(vocab_size: int = 512, text: str | None = None, seed: int = 0,
                         reserved_in_vocab: bool = False):
    """A `tokenizers.Tokenizer` of exactly `vocab_size` ids (see the module docstring for the layout).

    Training is deterministic for a given text; `seed` only permutes the order of the training paragraphs,
    so different seeds give different (but equally valid) merges. The ids the merges do not reach are reserved
    special tokens; `reserved_in_vocab`: plain vocabulary entries no merge produces instead, so that a tokenizer of
    the released vocabulary's size loads as fast as the released one (transformers loads 100K added tokens in
    seconds).
    """
    import random

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (3 specials, 256 bytes, 16 added tokens).")
    paragraphs = (text if text is not None else default_training_text()).split("\n\n")
    random.Random(seed).shuffle(paragraphs)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - TAIL_SIZE, special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    learned = tokenizer.get_vocab_size(with_added_tokens=True)
    fillers = [f"<｜reserved▁{i}｜>" for i in range(vocab_size - TAIL_SIZE - learned)]
    # a short training text learns fewer merges than asked for; reserved ids keep the tail ids fixed
    if reserved_in_vocab:
        layout = json.loads(tokenizer.to_str())
        layout["model"]["vocab"].update({token: learned + i for i, token in enumerate(fillers)})
        tokenizer = Tokenizer.from_str(json.dumps(layout))
    else:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fillers])
    tail = _tail_tokens(vocab_size)
    tokenizer.add_special_tokens([AddedToken(tail[i], special=True, normalized=False) for i in sorted(tail)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1", special_tokens=[(BOS_TOKEN, 0)],
    )
    for token_id, content in tail.items():
        if tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"tokenizer layout error: {content} got id {tokenizer.token_to_id(content)}")
    return tokenizer


def save_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512, text: str | None = None, seed: int = 0,
                        model_max_length: int = 65536, reserved_in_vocab: bool = False) -> TinyTokenizerIds:
    """Build the tokenizer and write tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast, left padding as
    a decoder-only model generates) and the chat template (chat_template.jinja, which AutoTokenizer and
    AutoProcessor both load) to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab_size, text, seed, reserved_in_vocab)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN, "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": model_max_length, "padding_side": "left",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(DEFAULT_CHAT_TEMPLATE, encoding="utf-8")
    return TinyTokenizerIds(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        image_token_id=tokenizer.token_to_id(IMAGE_TOKEN), noise_token_id=tokenizer.token_to_id(NOISE_TOKEN),
    )
