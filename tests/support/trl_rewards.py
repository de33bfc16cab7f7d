"""Reward functions written as for TRL's ``GRPOTrainer``, for the chat-model run.

Both are called once per group with ``prompts``, ``completions`` (conversational: a list
holding one assistant message), ``completion_ids`` and the row's columns; both return one
float per completion. ``answer_digits`` is async; ``two_digits`` raises on the rows whose
answer starts with 0, as a user's function with a bug would.
"""

from __future__ import annotations

import asyncio
from typing import Any


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", ...}]
        completion = completion[-1]["content"]
    return "".join(str(completion).split())


async def answer_digits(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """Half a point for each of the two answer digits in its place."""
    await asyncio.sleep(0)  # an async function, awaited on the producer's loop
    scores = []
    for completion, target in zip(completions, answer, strict=True):
        text = _text(completion)
        scores.append(sum(0.5 for a, t in zip(text, target, strict=False) if a == t))
    return scores


def two_digits(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1 for an answer of exactly two digits, 0.5 for digits only but another count;
    raises for answers starting with 0."""
    if any(target.startswith("0") for target in answer):
        raise ValueError("this reward cannot score a leading zero")
    texts = [_text(c) for c in completions]
    return [(1.0 if len(t) == 2 else 0.5) if t.isdigit() else 0.0 for t in texts]
