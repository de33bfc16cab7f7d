"""The sampling math of a batch: each row's own temperature, top-k, top-p and min-p,
applied to one decode step's logits, and the log-prob the engine reports.

Numerics, as SGLang's sampler defines them (``python/sglang/srt/layers/sampler.py``):
the returned log-prob of a sampled token is ``log softmax(logits / temperature)`` in
float32, taken *before* top-k / top-p / min-p filtering (those only change which token is
drawn). Temperature 0 means greedy, which SGLang implements as temperature 1 with
top_k = 1, so greedy log-probs are the raw ``log_softmax(logits)``. A trainer comparing
against these values must therefore divide its logits by the same temperature. (SGLang's
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` switches to the raw distribution; this engine has no
such switch: run at temperature 1 when raw and scaled must agree.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from producers.engine.requests import SAMPLING_EPS, Request


@dataclass(frozen=True)
class Knobs:
    """Per-row sampling settings as tensors (greedy = temperature 1 with top_k 1)."""

    temps: torch.Tensor  # [B, 1]
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B]
    min_ps: torch.Tensor  # [B]

    @classmethod
    def of(cls, live: list[Request], vocab_size: int) -> Knobs:
        temps, top_ps, top_ks, min_ps = [], [], [], []
        for request in live:
            p = request.params
            greedy = p.temperature < SAMPLING_EPS
            temps.append(1.0 if greedy else p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(1 if greedy else (p.top_k if p.top_k > 0 else vocab_size))
            min_ps.append(p.min_p)
        return cls(
            torch.tensor(temps, dtype=torch.float32)[:, None],
            torch.tensor(top_ps, dtype=torch.float32),
            torch.tensor(top_ks, dtype=torch.long),
            torch.tensor(min_ps, dtype=torch.float32),
        )

    def filtered(self, vocab_size: int) -> bool:
        return bool(
            (self.top_ks < vocab_size).any() or (self.top_ps < 1).any() or (self.min_ps > 0).any()
        )

    def select(self, index: torch.Tensor) -> Knobs:
        return Knobs(self.temps[index], self.top_ps[index], self.top_ks[index], self.min_ps[index])

    def cat(self, other: Knobs) -> Knobs:
        return Knobs(
            torch.cat([self.temps, other.temps]),
            torch.cat([self.top_ps, other.top_ps]),
            torch.cat([self.top_ks, other.top_ks]),
            torch.cat([self.min_ps, other.min_ps]),
        )


def sample(
    logits: torch.Tensor, knobs: Knobs, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return it with its log-prob under softmax(logits / T)."""
    logp = torch.log_softmax(logits / knobs.temps, dim=-1)
    probs = logp.exp()
    if not knobs.filtered(vocab_size):
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    else:
        # Filter on the sorted distribution (top-k, top-p, min-p), renormalise, draw.
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        ranks = torch.arange(sorted_probs.shape[-1])[None, :]
        drop = (cumulative - sorted_probs) > knobs.top_ps[:, None]
        drop |= ranks >= knobs.top_ks[:, None]
        drop |= sorted_probs < (sorted_probs[:, :1] * knobs.min_ps[:, None])
        drop[:, 0] = False  # the most likely token always survives
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        picked = torch.multinomial(sorted_probs, 1, generator=generator)
        tokens = order.gather(1, picked).squeeze(1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen.clamp(min=torch.finfo(chosen.dtype).min)
