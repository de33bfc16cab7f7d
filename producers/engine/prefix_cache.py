"""Keep the KV cache of finished sequences so a later request that extends one skips its
prefill: what SGLang's radix cache does, in its simplest form (a bounded LRU of whole
sequences, longest common prefix on lookup).

Why: a multi-turn episode sends each turn as one ``/generate`` with the whole history
(prompt, earlier turns, tool results). Without reuse every turn prefills that history
again, so an episode's prefill cost grows with the square of its turns. With reuse a turn
prefills only the tokens added since the last one (the previous turn's last token and
the environment's observation).

The keys a model caches already carry their rotary position, so an entry is only valid
at the positions it was computed at, which is how it is reused: as the first tokens of
the new sequence. Entries are only valid for the weights that computed them: the engine
clears the cache whenever it loads weights.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixEntry:
    """The KV of ``ids`` (one ``(keys, values)`` pair of ``[heads, len, dim]`` per layer)."""

    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class PrefixHit:
    """The first ``length`` positions of an entry: the KV a new request may start from."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]


class PrefixCache:
    """A bounded LRU of sequences and their KV; ``max_tokens`` bounds the memory."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()
        self.tokens = 0
        self._next_key = 0

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0

    def store(self, ids: Sequence[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV of ``ids``; entries that are a prefix of it are dropped (it serves
        everything they did), and the least recently used go while over budget."""
        length = len(ids)
        if length == 0 or length > self.max_tokens:
            return
        key = tuple(ids)
        for old_key, entry in list(self.entries.items()):
            if entry.length <= length and key[: entry.length] == entry.ids:
                self._drop(old_key)
        self.entries[self._next_key] = PrefixEntry(key, layers)
        self._next_key += 1
        self.tokens += length
        while self.tokens > self.max_tokens and self.entries:
            self._drop(next(iter(self.entries)))

    def lookup(self, ids: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of ``ids`` that leaves at least its last token to
        prefill (the logits of the next token come from that forward pass)."""
        limit = len(ids) - 1
        if limit <= 0 or not self.entries:
            return None
        query = tuple(ids[:limit])
        best_key, best_length = None, 0
        for key, entry in self.entries.items():
            n = min(entry.length, limit)
            if n <= best_length or entry.ids[0] != query[0]:
                continue
            common = common_prefix_length(entry.ids, query, n)
            if common > best_length:
                best_key, best_length = key, common
        if best_key is None:
            return None
        entry = self.entries[best_key]
        self.entries.move_to_end(best_key)
        return PrefixHit(
            best_length, [(k[:, :best_length], v[:, :best_length]) for k, v in entry.layers]
        )

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.tokens -= entry.length


def common_prefix_length(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``: a bisection over
    tuple slices, each compared in C (comparing each entry with small tensor ops instead
    took a third of the CPU engine's profile samples, more than the model itself)."""
    if a[:limit] == b[:limit]:
        return limit
    same, differ = 0, limit  # a[:same] == b[:same] and a[:differ] != b[:differ]
    while differ - same > 1:
        middle = (same + differ) // 2
        if a[:middle] == b[:middle]:
            same = middle
        else:
            differ = middle
    return same
