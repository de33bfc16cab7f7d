"""Record validation: one test per defect, all defects at once, and raw-bytes validation."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas.codec import encode
from schemas.trajectory import Trajectory
from schemas.validation import Defect, Reason, ValidationLimits, validate, validate_bytes

LIMITS = ValidationLimits(vocab_size=50_000)


def valid_record(**changes: Any) -> Trajectory:
    rng = np.random.default_rng(3)
    record = Trajectory.create(
        run_id="run-7",
        trajectory_id="traj-0001",
        group_id="group-0001",
        group_size=8,
        sample_index=3,
        producer_id="gen-a-0",
        region="region-a",
        task="reverse3",
        prompt_ids=rng.integers(0, 50_000, 256),
        response_ids=rng.integers(0, 50_000, 512),
        logp_infer=-rng.exponential(1.0, 512),
        segment_versions=[3, 4],
        segment_lengths=[200, 312],
        reward=1.0,
        reward_details={"exact": True},
        finish_reason="stop",
        created_at_ms=1_700_000_000_000,
        finished_at_ms=1_700_000_000_500,
    )
    return dataclasses.replace(record, **changes)


def with_value(field: str, index: int, value: float) -> np.ndarray:
    array = getattr(valid_record(), field).copy()
    array[index] = value
    return array


def exact_old(**changes: Any) -> dict[str, Any]:
    """Changes that attach ``logp_old`` (default: a valid one) with status "exact"."""
    return {"logp_old": np.full(512, -0.5, np.float32), "old_logits_status": "exact", **changes}


MT_LENGTHS = [100, 50, 200, 62, 100]  # policy, env, policy, env, policy: 512 tokens
MT_KINDS = [0, 1, 0, 1, 0]


def multi_turn(
    lengths: list[int] = MT_LENGTHS, kinds: list[int] = MT_KINDS, **changes: Any
) -> dict[str, Any]:
    """Changes that make ``valid_record`` a valid multi-turn episode (env log-probs 0.0);
    ``changes`` then override any field."""
    logp = valid_record().logp_infer.copy()
    if sum(lengths) == len(logp) and all(n >= 0 for n in lengths):
        logp[np.repeat(np.array(kinds) != 0, lengths)] = 0.0
    return {
        "logp_infer": logp,
        "turn_lengths": np.array(lengths, np.int32),
        "turn_kinds": np.array(kinds, np.uint8),
        "tool_calls": 2,
        "episode_end": "tool_timeout",
        **changes,
    }


def env_nonzero(index: int, value: float = -0.3) -> np.ndarray:
    logp = multi_turn()["logp_infer"].copy()
    logp[index] = value
    return logp


PEERS = ("alice", "bob", "alice", "", "alice")  # alice's turns, bob's, a tool's: MT_KINDS

ONE_SEGMENT = {
    "segment_versions": np.array([4], np.int64),
    "segment_lengths": np.array([512], np.int32),
}

# (case id, field changes, limits changes, expected reason, field the detail must name)
# fmt: off
CASES: list[tuple[str, dict[str, Any], dict[str, Any], Reason, str]] = [
    ("logp_infer_short", {"logp_infer": np.full(511, -1, np.float32)}, {},
     Reason.LENGTH_MISMATCH, "logp_infer"),
    ("logp_old_short", exact_old(logp_old=np.full(3, -1, np.float32)), {},
     Reason.LENGTH_MISMATCH, "logp_old"),
    ("segments_sum", {"segment_lengths": np.array([200, 311], np.int32)}, {},
     Reason.LENGTH_MISMATCH, "segment_lengths"),
    ("segment_counts", {"segment_versions": np.array([3, 4, 5], np.int64)}, {},
     Reason.SEGMENT_MISMATCH, "segment_lengths"),
    ("segment_zero", {"segment_lengths": np.array([0, 512], np.int32)}, {},
     Reason.SEGMENT_MISMATCH, "segment_lengths[0]"),
    ("segment_negative", {"segment_lengths": np.array([600, -88], np.int32)}, {},
     Reason.SEGMENT_MISMATCH, "segment_lengths[1]"),
    ("versions_decrease", {"segment_versions": np.array([4, 3], np.int64)}, {},
     Reason.SEGMENT_MISMATCH, "segment_versions"),
    ("logp_infer_nan", {"logp_infer": with_value("logp_infer", 7, np.nan)}, {},
     Reason.NONFINITE_LOGPROB, "logp_infer[7]"),
    ("logp_infer_posinf", {"logp_infer": with_value("logp_infer", 9, np.inf)}, {},
     Reason.NONFINITE_LOGPROB, "logp_infer[9]"),
    ("logp_old_neginf", exact_old(logp_old=np.r_[np.full(511, -1), -np.inf].astype(np.float32)),
     {}, Reason.NONFINITE_LOGPROB, "logp_old[511]"),
    ("logp_positive", {"logp_infer": with_value("logp_infer", 5, 0.5)}, {},
     Reason.POSITIVE_LOGPROB, "logp_infer[5]"),
    ("version_above_max", {}, {"max_version": 3}, Reason.VERSION_OUT_OF_RANGE, "segment_versions"),
    ("version_below_min", {}, {"min_version": 4}, Reason.VERSION_OUT_OF_RANGE, "segment_versions"),
    ("version_negative", {"segment_versions": np.array([-1, 4], np.int64)}, {},
     Reason.VERSION_OUT_OF_RANGE, "segment_versions"),
    ("token_negative", {"response_ids": with_value("response_ids", 10, -1)}, {},
     Reason.TOKEN_OUT_OF_RANGE, "response_ids[10]"),
    ("token_beyond_vocab", {"prompt_ids": with_value("prompt_ids", 0, 50_000)}, {},
     Reason.TOKEN_OUT_OF_RANGE, "prompt_ids[0]"),
    ("empty_response", {"response_ids": np.empty(0, np.int32),
                        "logp_infer": np.empty(0, np.float32),
                        "segment_versions": np.empty(0, np.int64),
                        "segment_lengths": np.empty(0, np.int32)}, {},
     Reason.EMPTY_RESPONSE, "response_ids"),
    ("response_too_long", {}, {"max_response_tokens": 100}, Reason.TOO_LONG, "response_ids"),
    ("prompt_too_long", {}, {"max_prompt_tokens": 255}, Reason.TOO_LONG, "prompt_ids"),
    ("oversize", {}, {"max_record_bytes": 1000}, Reason.OVERSIZE, "record"),
    ("reward_nan", {"reward": float("nan")}, {}, Reason.BAD_REWARD, "reward"),
    ("reward_inf", {"reward": float("-inf")}, {}, Reason.BAD_REWARD, "reward"),
    ("advantage_nan", {"advantage": float("nan")}, {}, Reason.BAD_REWARD, "advantage"),
    ("empty_run_id", {"run_id": ""}, {}, Reason.BAD_FIELD, "run_id"),
    ("empty_producer", {"producer_id": ""}, {}, Reason.BAD_FIELD, "producer_id"),
    ("finish_reason", {"finish_reason": "eos"}, {}, Reason.BAD_FIELD, "finish_reason"),
    ("sample_index", {"sample_index": 8}, {}, Reason.BAD_FIELD, "sample_index"),
    ("group_size", {"group_size": 0}, {}, Reason.BAD_FIELD, "group_size"),
    ("prompt_dtype", {"prompt_ids": valid_record().prompt_ids.astype(np.int64)}, {},
     Reason.BAD_FIELD, "prompt_ids"),
    ("response_list", {"response_ids": valid_record().response_ids.tolist()}, {},
     Reason.BAD_FIELD, "response_ids"),
    ("empty_prompt", {"prompt_ids": np.empty(0, np.int32)}, {}, Reason.BAD_FIELD, "prompt_ids"),
    ("status_unknown", {"old_logits_status": "fresh"}, {}, Reason.BAD_FIELD, "old_logits_status"),
    ("status_without_logits", {"old_logits_status": "exact"}, {},
     Reason.BAD_FIELD, "old_logits_status"),
    ("logits_without_status", {"logp_old": np.full(512, -0.5, np.float32)}, {},
     Reason.BAD_FIELD, "old_logits_status"),
    ("time_backwards", {"finished_at_ms": 1_600_000_000_000}, {},
     Reason.BAD_FIELD, "finished_at_ms"),
    ("details_not_json", {"reward_details": {"f": object()}}, {},
     Reason.BAD_FIELD, "reward_details"),
    ("group_size_int32", {"group_size": 2**31}, {}, Reason.BAD_FIELD, "group_size"),
    ("group_id_too_long", {"group_id": "g" * 60_000}, {}, Reason.FIELD_TOO_LONG, "group_id"),
    ("run_id_too_long", {"run_id": "r" * 257}, {}, Reason.FIELD_TOO_LONG, "run_id"),
    ("trajectory_id_too_long", {"trajectory_id": "é" * 129}, {},
     Reason.FIELD_TOO_LONG, "trajectory_id"),
    ("producer_id_too_long", {"producer_id": "p" * 257}, {}, Reason.FIELD_TOO_LONG, "producer_id"),
    ("region_too_long", {"region": "r" * 300}, {}, Reason.FIELD_TOO_LONG, "region"),
    ("task_too_long", {"task": "t" * 20}, {"max_id_bytes": 16}, Reason.FIELD_TOO_LONG, "task"),
    ("reward_details_too_long", {"reward_details": {"x": "y" * 70_000}}, {},
     Reason.FIELD_TOO_LONG, "reward_details"),
    # multi-turn layouts
    ("turn_sum", multi_turn(turn_lengths=np.array([100, 50, 200, 62, 99], np.int32)), {},
     Reason.TURN_MISMATCH, "turn_lengths"),
    ("turn_counts", multi_turn(turn_kinds=np.array([0, 1, 0, 1], np.uint8)), {},
     Reason.TURN_MISMATCH, "turn_kinds"),
    ("turn_half_none", multi_turn(turn_kinds=None), {}, Reason.TURN_MISMATCH, "turn_kinds"),
    ("turn_zero", multi_turn([100, 0, 250, 62, 100]), {}, Reason.EMPTY_TURN, "turn_lengths[1]"),
    ("turn_negative", multi_turn([100, 50, 200, -1, 163]), {},
     Reason.EMPTY_TURN, "turn_lengths[3]"),
    ("turn_kind_unknown", multi_turn(kinds=[0, 1, 0, 7, 0]), {},
     Reason.UNKNOWN_TURN_KIND, "turn_kinds[3]"),
    ("turn_kind_dtype", multi_turn(turn_kinds=np.array(MT_KINDS, np.int64)), {},
     Reason.BAD_FIELD, "turn_kinds"),
    ("first_turn_env", multi_turn([100, 50, 362], [1, 0, 1], **ONE_SEGMENT), {},
     Reason.FIRST_TURN_NOT_POLICY, "turn_kinds"),
    ("adjacent_policy", multi_turn([100, 50, 362], [0, 0, 1], **ONE_SEGMENT), {},
     Reason.ADJACENT_SAME_KIND, "turn_kinds[1]"),
    ("adjacent_env", multi_turn([100, 50, 362], [0, 1, 1], **ONE_SEGMENT), {},
     Reason.ADJACENT_SAME_KIND, "turn_kinds[2]"),
    ("env_logp_infer", multi_turn(logp_infer=env_nonzero(120)), {},
     Reason.ENV_LOGPROB_NONZERO, "logp_infer[120]"),
    ("env_logp_infer_negzero", multi_turn(logp_infer=env_nonzero(400, -0.0)), {},
     Reason.ENV_LOGPROB_NONZERO, "logp_infer[400]"),
    ("env_logp_old", multi_turn(**exact_old()), {}, Reason.ENV_LOGPROB_NONZERO, "logp_old[100]"),
    ("segment_in_env_turn", multi_turn(segment_lengths=np.array([120, 392], np.int32)), {},
     Reason.SEGMENT_IN_ENV_TURN, "segment_lengths"),
    ("tool_calls_negative", multi_turn(tool_calls=-1), {}, Reason.BAD_TOOL_CALLS, "tool_calls"),
    ("episode_end_unknown", multi_turn(episode_end="crashed"), {},
     Reason.UNKNOWN_EPISODE_END, "episode_end"),
    ("multi_turn_without_end", multi_turn(episode_end=""), {},
     Reason.EPISODE_END_MISMATCH, "episode_end"),
    # multi-policy provenance
    ("policy_slash", {"policy": "team/alice"}, {}, Reason.BAD_POLICY, "policy"),
    ("policy_too_long", {"policy": "p" * 65}, {}, Reason.BAD_POLICY, "policy"),
    ("policy_space", {"policy": "alice "}, {}, Reason.BAD_POLICY, "policy"),
    ("policy_newline", {"policy": "alice\n"}, {}, Reason.BAD_POLICY, "policy"),
    ("policy_not_str", {"policy": None}, {}, Reason.BAD_POLICY, "policy"),
    ("turn_policy_malformed",
     multi_turn(policy="alice", turn_policies=("alice", "bob", "alice", "x/y", "alice")), {},
     Reason.BAD_POLICY, "turn_policies[3]"),
    ("turn_policy_int", multi_turn(turn_policies=("", 1, "", "", "")), {},
     Reason.BAD_POLICY, "turn_policies[1]"),
    ("turn_policies_list", multi_turn(policy="alice", turn_policies=list(PEERS)), {},
     Reason.BAD_POLICY, "turn_policies"),
    ("turn_policies_without_turns", {"policy": "alice", "turn_policies": ("alice",)}, {},
     Reason.TURN_POLICY_MISMATCH, "turn_policies"),
    ("turn_policies_count", multi_turn(policy="alice", turn_policies=PEERS[:4]), {},
     Reason.TURN_POLICY_MISMATCH, "turn_policies"),
    ("policy_turn_of_another",
     multi_turn(policy="alice", turn_policies=("alice", "bob", "bob", "", "alice")), {},
     Reason.TURN_POLICY_MISMATCH, "turn_policies[2]"),
    ("env_turn_of_own_policy", multi_turn(policy="alice", turn_policies=("alice",) * 5), {},
     Reason.TURN_POLICY_MISMATCH, "turn_policies[1]"),
    ("policy_turn_of_the_unnamed_policy", multi_turn(turn_policies=("bob", "", "", "", "")), {},
     Reason.TURN_POLICY_MISMATCH, "turn_policies[0]"),
]
# fmt: on


def test_the_reference_record_is_valid() -> None:
    assert validate(valid_record(), LIMITS) == []
    assert validate(valid_record(**exact_old(), advantage=0.3), LIMITS) == []
    assert validate(valid_record(old_logits_status="off"), LIMITS) == []
    assert validate(valid_record(), ValidationLimits(min_version=3, max_version=4)) == []


@pytest.mark.parametrize(
    ("changes", "limit_changes", "reason", "named"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_defect_is_reported_alone_with_its_field(
    changes: dict[str, Any], limit_changes: dict[str, Any], reason: Reason, named: str
) -> None:
    record = valid_record(**changes)
    defects = validate(record, dataclasses.replace(LIMITS, **limit_changes))
    assert [d.reason for d in defects] == [reason], defects
    assert named in defects[0].detail
    assert defects[0].field == named.split("[")[0]


def test_multi_turn_records_are_valid() -> None:
    assert validate(valid_record(**multi_turn()), LIMITS) == []
    logp_old = multi_turn()["logp_infer"] - 0.0  # 0.0 stays +0.0
    changes = multi_turn(logp_old=logp_old, old_logits_status="exact")
    assert validate(valid_record(**changes), LIMITS) == []
    # a last env turn (an observation that ended the episode) is fine
    assert validate(valid_record(**multi_turn([300, 212], [0, 1])), LIMITS) == []
    # a single-turn record may still say why its episode ended (the policy answered at once)
    assert validate(valid_record(episode_end="done"), LIMITS) == []


def test_multi_policy_records_are_valid() -> None:
    assert validate(valid_record(policy="alice"), LIMITS) == []
    assert validate(valid_record(policy="Team_7-" + "x" * 57), LIMITS) == []  # 64 characters
    assert validate(valid_record(**multi_turn(policy="alice")), LIMITS) == []  # no per-turn
    peers = valid_record(**multi_turn(policy="alice", turn_policies=PEERS))
    assert validate(peers, LIMITS) == []
    # the unnamed policy may spell out that every env turn is the environment, or name peers
    spelled = valid_record(**multi_turn(turn_policies=("",) * 5))
    assert validate(spelled, LIMITS) == []
    assert validate(valid_record(**multi_turn(turn_policies=("", "bob", "", "", ""))), LIMITS) == []
    decoded, defects = validate_bytes(encode(peers), LIMITS)
    assert defects == [] and decoded == peers and decoded.turn_policies == PEERS


def test_turn_policy_mismatches_count_every_offending_turn() -> None:
    record = valid_record(**multi_turn(policy="alice", turn_policies=("bob",) * 5))
    (defect,) = validate(record, LIMITS)
    assert defect.reason == Reason.TURN_POLICY_MISMATCH
    assert defect.detail.startswith("turn_policies[0] names 'bob' on a POLICY turn")
    assert "(3 such turns)" in defect.detail  # the three policy turns; bob's env turns are fine


def test_policy_defects_come_with_the_others() -> None:
    record = valid_record(
        **multi_turn(policy="a b", turn_policies=PEERS[:4], episode_end="", reward=float("nan"))
    )
    reasons = [d.reason for d in validate(record, LIMITS)]
    assert reasons == [
        Reason.BAD_REWARD,
        Reason.EPISODE_END_MISMATCH,
        Reason.BAD_POLICY,
        Reason.TURN_POLICY_MISMATCH,
    ]


TRAINER_ONLY = {
    Reason.EMPTY_PROMPT,
    Reason.BAD_ADVANTAGE,
    Reason.MISSING_OLD_LOGITS,
    Reason.FOREIGN_POLICY,
    Reason.EMPTY_GROUP,
}
"""The reasons only the trainer's profile gives (their cases: test_trainable.py)."""


def test_every_reason_has_a_case() -> None:
    covered = {case[3] for case in CASES} | {Reason.DECODE_ERROR}  # decode: see below
    assert covered | TRAINER_ONLY == set(Reason)
    assert not covered & TRAINER_ONLY  # validate never gives them


def test_all_defects_are_reported_at_once() -> None:
    record = valid_record(
        run_id="",
        reward=float("nan"),
        logp_infer=with_value("logp_infer", 0, 2.0)[:500],
        segment_versions=np.array([9, 2], np.int64),
    )
    defects = validate(record, LIMITS)
    assert {d.reason for d in defects} == {
        Reason.BAD_FIELD,
        Reason.BAD_REWARD,
        Reason.LENGTH_MISMATCH,
        Reason.POSITIVE_LOGPROB,
        Reason.SEGMENT_MISMATCH,
    }
    assert all(isinstance(d, Defect) and d.detail for d in defects)


def test_counts_of_bad_values_are_reported() -> None:
    logp = valid_record().logp_infer.copy()
    logp[[3, 30, 300]] = np.nan
    (defect,) = validate(valid_record(logp_infer=logp), LIMITS)
    assert "logp_infer[3]" in defect.detail
    assert "3 non-finite" in defect.detail


def test_tiny_positive_log_probs_are_tolerated() -> None:
    record = valid_record(logp_infer=with_value("logp_infer", 0, 5e-5))
    assert validate(record, LIMITS) == []
    strict = dataclasses.replace(LIMITS, logprob_epsilon=0.0)
    assert [d.reason for d in validate(record, strict)] == [Reason.POSITIVE_LOGPROB]


def test_validate_bytes_accepts_a_good_record() -> None:
    record = valid_record()
    decoded, defects = validate_bytes(encode(record), LIMITS)
    assert defects == []
    assert decoded == record


def test_validate_bytes_reports_record_defects_with_the_record() -> None:
    record = valid_record(reward=float("inf"))
    decoded, defects = validate_bytes(encode(record), LIMITS)
    assert decoded == record
    assert [d.reason for d in defects] == [Reason.BAD_REWARD]


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "empty"),
        (b'{"prompt_ids": []}', "bad_magic"),
        (encode(valid_record())[:-10], "truncated"),
        (encode(valid_record()) + b"!", "trailing_bytes"),
        (encode(valid_record())[:-1] + b"\x00", "checksum_mismatch"),
    ],
)
def test_validate_bytes_maps_decode_errors(data: bytes, code: str) -> None:
    decoded, defects = validate_bytes(data, LIMITS)
    assert decoded is None
    assert [d.reason for d in defects] == [Reason.DECODE_ERROR]
    assert defects[0].detail.startswith(code)


def test_validate_bytes_reports_oversize_before_decoding() -> None:
    data = encode(valid_record())
    decoded, defects = validate_bytes(data, dataclasses.replace(LIMITS, max_record_bytes=1000))
    assert decoded is None
    assert [d.reason for d in defects] == [Reason.OVERSIZE]
    assert str(len(data)) in defects[0].detail


# Anything may arrive from a producer: validation must describe it, never crash.
junk_arrays = st.sampled_from(
    [
        np.empty(0, np.int32),
        np.array([1, -2, 3], np.int32),
        np.array([1, 2], np.int64),
        np.array([[1, 2]], np.int32),
        np.array([np.nan, 0.5, -1.0], np.float32),
        np.array([-1.0, -2.0], np.float64),
        np.array([2, 1], np.int64),
        [1, 2, 3],
        "not an array",
    ]
)
junk_scalars = st.sampled_from([0, -1, 1, 2**40, 1.5, float("nan"), None, "x", True, [1]])


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "prompt_ids": junk_arrays,
            "response_ids": junk_arrays,
            "logp_infer": junk_arrays,
            "logp_old": junk_arrays | st.none(),
            "segment_versions": junk_arrays,
            "segment_lengths": junk_arrays,
            "group_size": junk_scalars,
            "sample_index": junk_scalars,
            "reward": junk_scalars,
            "advantage": junk_scalars,
            "created_at_ms": junk_scalars,
            "finish_reason": junk_scalars,
            "old_logits_status": junk_scalars,
            "reward_details": st.sampled_from([{}, [], {"a": float("nan")}, {2: 1}]),
            "region": junk_scalars,
            "policy": junk_scalars | st.sampled_from(["", "alice", "a/b"]),
            "turn_policies": st.sampled_from(
                [None, (), ("alice",), ["alice"], ("alice", 1), "alice", ("a/b",), ("",) * 2]
            ),
        },
    )
)
def test_validate_never_crashes(changes: dict[str, Any]) -> None:
    defects = validate(valid_record(**changes), LIMITS)
    assert all(isinstance(d.reason, Reason) and d.field in d.detail for d in defects)
    if changes and not defects:
        # Only harmless changes may pass: re-check the record still encodes and decodes.
        assert validate_bytes(encode(valid_record(**changes)), LIMITS)[1] == []


def test_nan_and_positive_log_probs_are_both_reported() -> None:
    logp = with_value("logp_infer", 0, np.nan)
    logp[5] = 0.5
    reasons = [d.reason for d in validate(valid_record(logp_infer=logp), LIMITS)]
    assert reasons == [Reason.NONFINITE_LOGPROB, Reason.POSITIVE_LOGPROB]


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        512,
        elements=st.sampled_from([-1.0, -1e-3, 0.0, 1e-5, 0.5, np.nan, np.inf, -np.inf])
        | st.floats(width=32),
    )
)
def test_log_prob_checks_agree_with_a_plain_reference(logp: np.ndarray) -> None:
    reasons = {d.reason for d in validate(valid_record(logp_infer=logp), LIMITS)}
    finite = np.isfinite(logp)
    assert (Reason.NONFINITE_LOGPROB in reasons) == (not finite.all())
    positive = finite & (logp > LIMITS.logprob_epsilon)
    assert (Reason.POSITIVE_LOGPROB in reasons) == bool(positive.any())
