"""The KV cache of a running batch: built by a left-padded prefill (after the rows' cached
prefixes, when the prefix cache has them), grown by requests that join the batch, and
handed to the prefix cache when rows finish.

Every row is left-padded to the batch's width and the attention mask hides the padding;
positions count only a row's real tokens. Kept apart from the scheduler because these
layout rules are what must agree between prefill, join and the prefix cache, and a
mistake in them corrupts outputs silently instead of failing.
"""

from __future__ import annotations

from typing import Any

import torch

from producers.engine.prefix_cache import PrefixCache, PrefixHit
from producers.engine.requests import Request

#: a batch's KV cache, last logits [B, V], attention mask [B, L], last positions [B]
Prefill = tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]


def _left_pad(states: torch.Tensor, pad: int) -> torch.Tensor:
    """Left-pad a [B, H, L, D] cache tensor by ``pad`` positions (none if ``pad <= 0``)."""
    return torch.nn.functional.pad(states, (0, 0, pad, 0)) if pad > 0 else states


def _left_pad_mask(mask: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (pad, 0)) if pad > 0 else mask


def is_dynamic_layer(layer: Any) -> bool:
    """Whether rows can join the cache: only plain dynamic layers can be padded in place."""
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer


def prefill(model: Any, pad_id: int, rows: list[list[int]]) -> Prefill:
    """Left-padded prefill: the KV cache, last logits, attention mask, last positions."""
    from transformers import DynamicCache

    width = max(len(prompt) for prompt in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, prompt in enumerate(rows):
        n = len(prompt)
        ids[row, width - n :] = torch.tensor(prompt)
        mask[row, width - n :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return cache, out.logits[:, -1, :].float(), mask, positions[:, -1]


def prefill_after_prefixes(
    model: Any, pad_id: int, rows: list[list[int]], hits: list[PrefixHit | None]
) -> Prefill:
    """Prefill only what follows each row's cached prefix. The cache starts as the
    prefixes, left-padded to the longest; the new tokens follow, left-padded too, so
    a row's padding may sit between its prefix and its new tokens: the attention mask
    hides it and positions count only real tokens, as the prefix was computed."""
    from transformers import DynamicCache

    reused = [0 if hit is None else hit.length for hit in hits]
    prefix = max(reused)
    width = max(len(prompt) - n for prompt, n in zip(rows, reused, strict=True))
    count = len(rows)
    ids = torch.full((count, width), pad_id, dtype=torch.long)
    mask = torch.zeros((count, prefix + width), dtype=torch.long)
    for row, (prompt, n) in enumerate(zip(rows, reused, strict=True)):
        new = prompt[n:]
        ids[row, width - len(new) :] = torch.tensor(new)
        mask[row, prefix - n : prefix] = 1
        mask[row, prefix + width - len(new) :] = 1
    cache = DynamicCache(config=model.config)
    template = next(hit for hit in hits if hit is not None)
    for layer, (keys, values) in enumerate(template.layers):
        heads, _, dim = keys.shape
        all_keys = keys.new_zeros((count, heads, prefix, dim))
        all_values = values.new_zeros((count, heads, prefix, values.shape[-1]))
        for row, hit in enumerate(hits):
            if hit is not None:
                all_keys[row, :, prefix - hit.length :] = hit.layers[layer][0]
                all_values[row, :, prefix - hit.length :] = hit.layers[layer][1]
        cache.update(all_keys, all_values, layer)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions[:, prefix:],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return cache, out.logits[:, -1, :].float(), mask, positions[:, -1]


def append_rows(
    cache: Any, mask: torch.Tensor, new_cache: Any, new_mask: torch.Tensor
) -> torch.Tensor:
    """Append ``new_cache``'s rows to ``cache`` (in place), the shorter of the two
    left-padded (masked out) to the longer; returns the joint attention mask."""
    gap = mask.shape[1] - new_mask.shape[1]
    for old, new in zip(cache.layers, new_cache.layers, strict=True):
        old_keys, new_keys = _left_pad(old.keys, -gap), _left_pad(new.keys, gap)
        old_values, new_values = _left_pad(old.values, -gap), _left_pad(new.values, gap)
        old.keys = torch.cat([old_keys, new_keys], dim=0)
        old.values = torch.cat([old_values, new_values], dim=0)
    return torch.cat([_left_pad_mask(mask, -gap), _left_pad_mask(new_mask, gap)], dim=0)


def keep_prefixes(
    prefix_cache: PrefixCache | None,
    rows: list[Request],
    keep: list[int],
    cache: Any,
    mask: torch.Tensor,
) -> None:
    """Store the KV of the rows that just finished: every token fed so far (the
    prompt and all output but the last sampled token, which was never fed)."""
    if prefix_cache is None or len(keep) == len(rows):
        return
    kept = set(keep)
    for row, request in enumerate(rows):
        if row in kept:
            continue
        positions = mask[row].nonzero().squeeze(1)  # found once, used for every layer
        fed = request.input_ids + request.output_ids[:-1]
        if len(positions) != len(fed):
            continue  # not the layout this row was prefilled with: never guess
        # index_select copies: the entries own their memory, not views of the batch cache
        layers = [
            (
                layer.keys[row].index_select(1, positions),
                layer.values[row].index_select(1, positions),
            )
            for layer in cache.layers
        ]
        prefix_cache.store(fed, layers)
