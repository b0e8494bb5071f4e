"""The Engram hasher, beside the Engram layer (`engram.py`, which looks the rows up and gates them in): the
compressed token map, the per-layer primes and multipliers, the hash ids, and `DeepseekV41EngramHasher`, which
turns a forward's token ids into every Engram layer's table rows and starts gathering rows of tables kept off the
compute device.

Every position is hashed as its 2-gram .. max_ngram-gram over compressed token ids; each (n-gram size, head)
owns a prime-sized bucket range of the layer's table. Look-back stops at the start of the sequence and at dead
positions (image spans, padding).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..kernels.engram_hash import DEAD, engram_rows

_NORMALIZED_SPACE = "\ue000"  # keeps a token that is exactly one space from collapsing to ""


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(config) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per Engram layer, per n-gram size, one bucket prime per head: searching up from engram_vocab_size - 1
    again for every n-gram size, never reusing a prime across heads, sizes or layers."""
    seen: set[int] = set()
    primes = []
    for _ in config.engram_layer_ids:
        per_ngram = []
        for _ in range(config.engram_max_ngram_size - 1):
            heads, candidate = [], config.engram_vocab_size - 1
            for _ in range(config.engram_n_heads):
                candidate += 1
                while candidate in seen or not is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                heads.append(candidate)
            per_ngram.append(tuple(heads))
        primes.append(tuple(per_ngram))
    return tuple(primes)


def engram_table_rows(config) -> list[int]:
    """The table size each Engram layer needs: the sum of its bucket primes."""
    return [sum(sum(p) for p in layer) for layer in engram_primes(config)]


@dataclass(frozen=True)
class EngramHashLayout:
    """Primes [layer][n-gram][head], bucket offsets and hash multipliers of every Engram layer."""

    layer_ids: tuple[int, ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    multipliers: tuple[tuple[int, ...], ...]
    max_ngram_size: int
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(cls, config) -> "EngramHashLayout":
        primes = engram_primes(config)
        for layer, rows, layer_primes in zip(config.engram_layer_ids, config.engram_num_embeddings, primes):
            needed = sum(sum(p) for p in layer_primes)
            if rows != needed:
                raise ValueError(
                    f"Engram layer {layer}: engram_num_embeddings is {rows} but its {len(layer_primes)}x"
                    f"{config.engram_n_heads} prime bucket ranges need exactly {needed} rows."
                )
        bound = max(1, (np.iinfo(np.int64).max // config.engram_compressed_vocab_size) // 2)
        multipliers = []
        for layer in config.engram_layer_ids:
            draws = np.random.default_rng(10007 * layer).integers(0, bound, size=(config.engram_max_ngram_size,),
                                                                 dtype=np.int64)
            multipliers.append(tuple(int(v) * 2 + 1 for v in draws))  # odd
        return cls(tuple(config.engram_layer_ids), tuple(primes), tuple(multipliers), config.engram_max_ngram_size)

    @functools.cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(primes [L, n-1, heads], offsets [L, (n-1)*heads], multipliers [L, n]) as int64 tensors."""
        primes = torch.tensor(self.primes, dtype=torch.int64)
        flat = primes.flatten(1)
        offsets = torch.cumsum(flat, dim=1) - flat
        return primes, offsets, torch.tensor(self.multipliers, dtype=torch.int64)

    def tensors_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`tensors` on `device`, copied once (a step then copies nothing from the host)."""
        if device not in self._on_device:
            self._on_device[device] = tuple(t.to(device) for t in self.tensors)
        return self._on_device[device]


def default_token_map(vocab_size: int, compressed_vocab_size: int, start: int = 0) -> torch.Tensor:
    """The Engram token map of a model without a tokenizer (built from a config, to train from scratch), and the
    entries of ids added by resizing: token id modulo the compressed vocabulary, for ids start .. vocab_size - 1."""
    return torch.arange(start, vocab_size, dtype=torch.int64) % compressed_vocab_size


def build_compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Each vocab id decoded alone and normalized; ids whose normalized text is equal share a compressed id.

    `tokenizer` is a transformers fast tokenizer or a `tokenizers.Tokenizer`. Returns (map, compressed size).
    """
    from tokenizers import Regex, normalizers

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _NORMALIZED_SPACE),
        normalizers.Strip(), normalizers.Replace(_NORMALIZED_SPACE, " "),
    ])
    size = len(tokenizer) if hasattr(tokenizer, "backend_tokenizer") else backend.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    mapping = []
    for token_id in range(size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte: key it by its raw token string
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        mapping.append(keys.setdefault(key, len(keys)))
    return mapping, len(keys)


class DeepseekV41EngramHasher:
    """Hashes a forward's token ids into global Engram table rows [B,S,n_engram_layers,columns], every Engram
    layer at once, with n-grams reaching back into the store's history of compressed ids.

    A plain object, not a module: the compressed token map it reads is the base model's `engram_token_map` buffer
    (the checkpoint's name for it), handed to each call rather than held, so a moved or resized map is always the
    one read."""

    def __init__(self, text_config, engram_layers: tuple[int, ...]) -> None:
        self.layout = EngramHashLayout.from_config(text_config)
        self.engram_layers = engram_layers  # backbone layer indices, in engram slot order (the plan's)
        self.vocab_size = text_config.vocab_size
        self.compressed_vocab_size = text_config.engram_compressed_vocab_size
        self.pad_token_id = text_config.engram_pad_token_id
        self.max_ngram_size = text_config.engram_max_ngram_size

    def default_token_map(self) -> torch.Tensor:
        """The token map of a model built without a tokenizer: token id modulo the compressed vocabulary."""
        return default_token_map(self.vocab_size, self.compressed_vocab_size)

    @staticmethod
    def compress(token_map: torch.Tensor, input_ids: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        """Compressed ids [B,S] of `input_ids`, `DEAD` where `dead` (image spans, padding) cuts every n-gram."""
        compressed = token_map[input_ids]
        return compressed if dead is None else compressed.masked_fill(dead, DEAD)

    def rows(self, token_map: torch.Tensor, input_ids: torch.Tensor, dead: torch.Tensor | None, store,
             replayed: int = 0) -> torch.Tensor:
        """Global table rows [B,S,n_engram_layers,columns] of every position of `input_ids`. The compressed ids
        are appended to `store`'s history (a cache's, or a throw-away ChunkStore's), whose earlier ids the
        n-grams of the first positions reach back into."""
        history = store.append_history(self.compress(token_map, input_ids, dead), replayed)
        pad = token_map[self.pad_token_id]  # a 0-dim tensor: no host read
        primes, offsets, multipliers = self.layout.tensors_on(input_ids.device)
        return engram_rows(history, pad, self.max_ngram_size, input_ids.shape[1], primes, offsets, multipliers)

    def prefetch(self, layers: nn.ModuleList, rows: torch.Tensor) -> None:
        """Start the gather (and host-to-device copy) of every externally stored Engram table's `rows` for this
        forward, before any layer runs. Tables on the device need nothing: their lookup is a device gather."""
        for index in self.engram_layers:  # the plan names the Engram layers: no scan of every block per forward
            layer = layers[index]
            table = layer.engram.embed
            if getattr(table, "external", None) is None:
                continue
            table.pending = table.external.start(rows, layer.spec.engram_slot, rows.device)
