"""A math reward built on ``math-verify``, as a TRL-style reward function.

``math_accuracy`` compares each completion's final answer with the row's ``solution``
column the way ``math-verify`` does: LaTeX and plain expressions, ``\\boxed{}``, fractions
against decimals, sets and intervals, so ``\\frac{1}{2}`` and ``0.5`` agree. Name it in a
file task's ``rewards`` as ``producers.tasks.math_reward:math_accuracy``.

math-verify's own timeouts use ``signal.alarm``, which works only on a main thread; the
producer runs sync reward functions in worker threads under its own timeout, so they are
switched off here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of its last message."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def math_accuracy(
    completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any
) -> list[float | None]:
    """1.0 where a completion's answer equals ``solution`` under math-verify, else 0.0;
    ``None`` where the solution itself has no parsable answer (nothing to compare)."""
    from math_verify import parse, verify

    values: list[float | None] = []
    for completion, gold_text in zip(completions, solution, strict=True):
        gold = parse(str(gold_text), parsing_timeout=None)  # type: ignore[arg-type]
        if not gold:
            values.append(None)
            continue
        answer = parse(completion_text(completion), parsing_timeout=None)  # type: ignore[arg-type]
        values.append(float(verify(gold, answer, timeout_seconds=None)))
    return values
