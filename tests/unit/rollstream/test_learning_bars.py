"""The learning bars reject a policy that learned only the format.

The tiny run (test_e2e_pipeline) passes when its reward rises and its late answers' digits
are right ``TINY_MIN_ACCURACY`` of the time. A policy that answers in the right format
(two digits, then EOS) without reading its prompt, scored by the task's own reward on the
task's own prompts, must fail that bar, however well it learned the format; one that reads
its prompt must pass it. The propose-solve run's proposer (test_multi_policy_e2e) passes
when problems of its seed digit become more frequent and clear ``seed_blind_bar``, which a
proposer blind to its seed does not.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from support.up_runs import (
    SEED_BLIND_FRAC,
    SEED_MIN_GAIN,
    TINY_MIN_ACCURACY,
    digit_accuracy,
    seed_blind_bar,
)

from core.models import DIGIT0_ID, EOS_ID
from producers.tasks.base import score_digits

pytestmark = pytest.mark.unit


def _samples(answer_of: object, count: int = 4000, seed: int = 0) -> list[SimpleNamespace]:
    """Scored samples of ``copy-first-digit-twice``: ``answer_of(digits, rng)`` answers."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        digits = [rng.randrange(10) for _ in range(3)]
        answer = answer_of(digits, rng)  # type: ignore[operator]
        ids = [DIGIT0_ID + d for d in answer] + [EOS_ID]
        reward, details = score_digits([digits[0], digits[0]], ids)
        samples.append(SimpleNamespace(reward=reward, reward_details=details))
    return samples


def test_a_format_only_policy_fails_the_content_bar() -> None:
    for name, policy in {
        "always 77": lambda digits, rng: [7, 7],
        "a random digit twice": lambda digits, rng: [rng.randrange(10)] * 2,
        "the prompt's last digit twice": lambda digits, rng: [digits[2]] * 2,
    }.items():
        samples = _samples(policy)
        assert all(s.reward_details["format_ok"] for s in samples), name
        accuracy, reward = digit_accuracy(samples), sum(s.reward for s in samples) / len(samples)
        print(f"{name}: digits right {accuracy:.3f}, reward {reward:.3f}")
        assert accuracy < TINY_MIN_ACCURACY, (name, accuracy)


def test_a_policy_that_reads_its_prompt_passes_it_even_when_half_right() -> None:
    def half_right(digits: list[int], rng: random.Random) -> list[int]:
        return [digits[0]] * 2 if rng.random() < 0.5 else [rng.randrange(10)] * 2

    assert digit_accuracy(_samples(half_right)) > TINY_MIN_ACCURACY


def test_a_seed_blind_proposer_fails_the_proposers_content_bar() -> None:
    """500 runs of a proposer that starts its problems with a random digit (128 problems a
    step, 60 steps, as the run's proposer): none clears both bars of the run's proposer;
    the slowest run seen under the suite's load (0.063 -> 0.198) clears them."""
    rng = random.Random(0)
    per_step, steps = 128, 60
    passed = 0
    for _ in range(500):
        hits = [sum(rng.random() < SEED_BLIND_FRAC for _ in range(per_step)) for _ in range(steps)]
        fracs = [h / per_step for h in hits]
        first, last = sum(fracs[:10]) / 10, sum(fracs[-10:]) / 10
        passed += last >= first + SEED_MIN_GAIN and last >= seed_blind_bar(10 * per_step)
    assert passed == 0
    slowest_first, slowest_last = 0.063, 0.198
    assert slowest_last >= slowest_first + SEED_MIN_GAIN
    assert slowest_last >= seed_blind_bar(10 * per_step)
