"""The trainer's profile of the record contract: one case per refusal, the first one wins,
and a group is refused with the reason of its first refused sample."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from support.synthetic import scored_group, synthetic_groups

from schemas.trainable import check_trainable, check_trainable_group
from schemas.trajectory import TURN_KIND_DTYPE, TURN_LENGTH_DTYPE, Trajectory, TurnKind
from schemas.validation import Reason, ValidationLimits

LIMITS = ValidationLimits(vocab_size=16, max_total_tokens=32)


def sample(**changes: Any) -> Trajectory:
    """A scored sample (4 prompt and 6 response tokens, exact old logits, an advantage)."""
    (group,) = synthetic_groups(1, seed=5, vary_lengths=False)
    traj = scored_group(group).samples[0]
    return dataclasses.replace(traj, **changes)


def turns(lengths: list[int], kinds: list[int]) -> dict[str, np.ndarray]:
    return {
        "turn_lengths": np.array(lengths, TURN_LENGTH_DTYPE),
        "turn_kinds": np.array(kinds, TURN_KIND_DTYPE),
    }


S = sample()
N = S.num_response_tokens
# (case id, field changes, limits changes, expected reason, field at fault)
# fmt: off
CASES: list[tuple[str, dict[str, Any], dict[str, Any], Reason, str]] = [
    ("empty_prompt", {"prompt_ids": S.prompt_ids[:0]}, {}, Reason.EMPTY_PROMPT, "prompt_ids"),
    ("advantage_nan", {"advantage": float("nan")}, {}, Reason.BAD_ADVANTAGE, "advantage"),
    ("advantage_none", {"advantage": None}, {}, Reason.BAD_ADVANTAGE, "advantage"),
    ("logp_infer_short", {"logp_infer": S.logp_infer[:-1]}, {},
     Reason.LENGTH_MISMATCH, "logp_infer"),
    ("logp_old_long", {"logp_old": np.append(S.logp_old, np.float32(-1))}, {},
     Reason.LENGTH_MISMATCH, "logp_old"),
    ("exact_without_old", {"logp_old": None}, {}, Reason.MISSING_OLD_LOGITS, "logp_old"),
    ("too_long", {}, {"max_total_tokens": 9}, Reason.TOO_LONG, "response_ids"),
    ("token_beyond_vocab", {"response_ids": S.response_ids + 16}, {},
     Reason.TOKEN_OUT_OF_RANGE, "response_ids"),
    ("token_negative", {"prompt_ids": S.prompt_ids - 100}, {"vocab_size": None},
     Reason.TOKEN_OUT_OF_RANGE, "prompt_ids"),
    ("logp_old_inf", {"logp_old": np.full(N, -np.inf, np.float32)}, {},
     Reason.NONFINITE_LOGPROB, "logp_old"),
    ("segments_sum", {"segment_lengths": np.array([N + 1], np.int32)}, {},
     Reason.SEGMENT_MISMATCH, "segment_lengths"),
    ("turns_sum", turns([N - 1], [TurnKind.POLICY]), {}, Reason.TURN_MISMATCH, "turn_lengths"),
    ("turns_count", turns([1, N - 1], [TurnKind.POLICY]), {},
     Reason.TURN_MISMATCH, "turn_lengths"),
    ("turn_kinds_only", {"turn_kinds": np.array([0], TURN_KIND_DTYPE)}, {},
     Reason.TURN_MISMATCH, "turn_kinds"),
    ("empty_turn", turns([0, N], [TurnKind.ENV, TurnKind.POLICY]), {},
     Reason.EMPTY_TURN, "turn_lengths"),
]
# fmt: on
TRAINER_REASONS = {case[3] for case in CASES} | {Reason.FOREIGN_POLICY, Reason.EMPTY_GROUP}
"""Every reason the trainer refuses with."""


def test_the_trainer_only_reasons_have_cases() -> None:
    only = {"empty_prompt", "bad_advantage", "missing_old_logits", "foreign_policy", "empty_group"}
    assert only <= {str(reason) for reason in TRAINER_REASONS}


def test_a_scored_sample_is_trainable() -> None:
    assert check_trainable(S, LIMITS) is None
    assert check_trainable(S, ValidationLimits()) is None  # no vocabulary or context given
    assert check_trainable_group(scored_group([S]), LIMITS) is None


@pytest.mark.parametrize(
    ("changes", "limit_changes", "reason", "field"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_refusal_has_its_reason_and_field(
    changes: dict[str, Any], limit_changes: dict[str, Any], reason: Reason, field: str
) -> None:
    limits = dataclasses.replace(LIMITS, **limit_changes)
    defect = check_trainable(sample(**changes), limits)
    assert defect is not None
    assert (defect.reason, defect.field) == (reason, field)
    assert str(defect).startswith(f"{reason.value}: ")  # the DLQ's reason, then its detail


def test_the_first_problem_wins() -> None:
    """Inputs before lengths before size before values before layout."""
    traj = sample(
        advantage=None,
        logp_infer=np.full(N - 1, np.nan, np.float32),
        segment_lengths=np.array([1], np.int32),
    )
    assert check_trainable(traj, LIMITS).reason == Reason.BAD_ADVANTAGE  # type: ignore[union-attr]
    fixed = dataclasses.replace(traj, advantage=0.5)
    assert check_trainable(fixed, LIMITS).reason == Reason.LENGTH_MISMATCH  # type: ignore[union-attr]


def test_a_group_is_refused_for_its_first_refused_sample() -> None:
    (samples,) = synthetic_groups(1, seed=6, group_size=3, vary_lengths=False)
    group = scored_group(samples)
    bad = dataclasses.replace(group.samples[1], advantage=float("inf"))
    refused = dataclasses.replace(group, samples=(group.samples[0], bad, group.samples[2]))
    defect = check_trainable_group(refused, LIMITS)
    assert defect is not None and defect.reason == Reason.BAD_ADVANTAGE
    assert defect.detail == f"trajectory {bad.trajectory_id}: inf"


def test_a_group_of_another_policy_or_of_no_sample_is_refused() -> None:
    group = scored_group([S])
    foreign = check_trainable_group(group, LIMITS, policy="solver")
    assert foreign is not None and foreign.reason == Reason.FOREIGN_POLICY
    assert "this trainer trains 'solver'" in foreign.detail
    empty = dataclasses.replace(group, samples=(), diagnostics=())
    nothing = check_trainable_group(empty, LIMITS)
    assert nothing is not None and nothing.reason == Reason.EMPTY_GROUP
    assert nothing.detail == f"group {group.group_id} has no samples"
