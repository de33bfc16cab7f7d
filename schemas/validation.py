"""Checks a trajectory before it may reach the trainer, reporting every defect at once.

Each ``Defect`` has a stable ``reason`` code (for dead-letter routing and metrics), the
``field`` at fault and a ``detail`` sentence naming the field and the offending values,
so a dead-lettered record explains itself. ``validate_bytes`` handles a raw Kafka value
in one call: undecodable bytes become a single ``decode_error`` (or ``oversize``) defect.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import orjson

from schemas.codec import MAX_RECORD_BYTES, DecodeError, DecodeReason, decode, encoded_size
from schemas.trajectory import (
    ARRAY_DTYPES,
    EpisodeEnd,
    FinishReason,
    OldLogitsStatus,
    Trajectory,
    TurnKind,
)


class Reason(StrEnum):
    """Why a record is rejected."""

    LENGTH_MISMATCH = "length_mismatch"
    SEGMENT_MISMATCH = "segment_mismatch"
    NONFINITE_LOGPROB = "nonfinite_logprob"
    POSITIVE_LOGPROB = "positive_logprob"
    VERSION_OUT_OF_RANGE = "version_out_of_range"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    EMPTY_RESPONSE = "empty_response"
    TOO_LONG = "too_long"
    OVERSIZE = "oversize"
    BAD_REWARD = "bad_reward"
    BAD_FIELD = "bad_field"
    DECODE_ERROR = "decode_error"  # detail starts with the codec's DecodeReason
    # Multi-turn episodes.
    TURN_MISMATCH = "turn_mismatch"  # turn_lengths/turn_kinds counts, or sum != response
    EMPTY_TURN = "empty_turn"  # a turn of length <= 0
    UNKNOWN_TURN_KIND = "unknown_turn_kind"
    FIRST_TURN_NOT_POLICY = "first_turn_not_policy"
    ADJACENT_SAME_KIND = "adjacent_same_kind"  # two policy (or env) turns in a row
    SEGMENT_IN_ENV_TURN = "segment_in_env_turn"  # a version change inside an env turn
    ENV_LOGPROB_NONZERO = "env_logprob_nonzero"  # logp_infer/logp_old != 0.0 at env tokens
    BAD_TOOL_CALLS = "bad_tool_calls"
    UNKNOWN_EPISODE_END = "unknown_episode_end"
    EPISODE_END_MISMATCH = "episode_end_mismatch"  # multi-turn without a reason, or vice versa
    # Multi-policy runs.
    BAD_POLICY = "bad_policy"  # a policy name (or turn_policies) the format does not allow
    TURN_POLICY_MISMATCH = "turn_policy_mismatch"  # turn_policies disagree with the turns
    FIELD_TOO_LONG = "field_too_long"  # an id or reward_details beyond its declared bound
    # The trainer's profile (``schemas.trainable``): what one training step cannot take.
    EMPTY_PROMPT = "empty_prompt"  # no token to predict the first response token from
    BAD_ADVANTAGE = "bad_advantage"  # a scored sample without a finite advantage
    MISSING_OLD_LOGITS = "missing_old_logits"  # status exact but no logp_old
    FOREIGN_POLICY = "foreign_policy"  # a sample of a policy this trainer does not train
    EMPTY_GROUP = "empty_group"  # a scored group of no samples


@dataclass(frozen=True, slots=True)
class Defect:
    """One problem of a record: a stable code, the field at fault, and a sentence."""

    reason: Reason
    field: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


MAX_GROUP_SIZE = 1024
"""Default bound on a record's ``group_size`` (``[streams.validation] max_group_size``)."""

MAX_GROUP_SIZE_LIMIT = 4096
"""Highest ``max_group_size`` a configuration may set: the stream rewrites a group's state
per sample (quadratic in the size) and emits the whole group as one Kafka record."""

MAX_ID_BYTES = 256
"""Default bound (UTF-8 bytes) on each id of a record (``run_id``, ``group_id``, ...): the
group id is the Kafka key and a header of every record the stream emits for the group, and
is repeated in each of its samples, so an unbounded id breaks the emitted record's size."""

MAX_REWARD_DETAILS_BYTES = 64 * 1024
"""Default bound on a record's ``reward_details`` as JSON: repeated in every sample of a
scored group, it must leave the group's tokens the room of the record."""


@dataclass(frozen=True, slots=True)
class ValidationLimits:
    """What a record may contain. ``None`` switches a check off.

    ``max_version`` is typically the trainer's current version + 1 (no record can come
    from the future); ``min_version`` the oldest version the run still accepts.
    ``logprob_epsilon`` tolerates the tiny positive log-probs float rounding produces.
    ``vocab_size`` and ``max_total_tokens`` (prompt + response) come from the model the
    record will be run through: an id outside its vocabulary or a sequence longer than its
    context cannot be scored and would fail the whole group's forward pass.
    ``max_group_size`` bounds the group a record may claim: the stream keeps a group's
    state until it closes and rewrites it per sample, so an unbounded claim is unbounded
    memory and work. ``max_id_bytes`` bounds every string id (UTF-8 bytes) and
    ``max_reward_details_bytes`` the JSON of ``reward_details``; ``policy`` and
    ``turn_policies`` are bounded by ``POLICY_NAME``, the other strings are enums.
    """

    vocab_size: int | None = None
    max_total_tokens: int | None = None
    max_prompt_tokens: int = 32_768
    max_response_tokens: int = 32_768
    max_record_bytes: int = MAX_RECORD_BYTES
    max_group_size: int = MAX_GROUP_SIZE
    max_id_bytes: int = MAX_ID_BYTES
    max_reward_details_bytes: int = MAX_REWARD_DETAILS_BYTES
    min_version: int | None = None
    max_version: int | None = None
    logprob_epsilon: float = 1e-4


_INT32_MAX = 2**31 - 1
_ID_FIELDS = ("run_id", "trajectory_id", "group_id", "producer_id", "region", "task")
_FINISH_REASONS = frozenset(FinishReason)
_STATUSES = frozenset(OldLogitsStatus)
_STATUSES_WITH_LOGITS = frozenset({OldLogitsStatus.EXACT, OldLogitsStatus.APPROX})
_EPISODE_ENDS = frozenset(EpisodeEnd)
_TURN_ARRAYS = ("turn_lengths", "turn_kinds")
POLICY_NAME = re.compile(r"[A-Za-z0-9_-]{0,64}")
"""What a policy name may be (whole string; ``""`` is the run's single, unnamed policy):
it travels in the ``rs-policy`` header and may name topics, metrics and S3 prefixes."""


def validate(traj: Trajectory, limits: ValidationLimits) -> list[Defect]:
    """Every defect of ``traj`` under ``limits``; an empty list means the record is fine."""
    defects: list[Defect] = []
    arrays = _check_arrays(traj, defects)  # only well-typed arrays are checked further
    _check_identity(traj, limits, defects)
    _check_scalars(traj, limits, defects)
    _check_tokens(arrays, limits, defects)
    _check_logprobs(arrays, limits, defects)
    _check_segments(arrays, limits, defects)
    _check_turns(traj, arrays, defects)
    _check_policies(traj, arrays, defects)
    _check_size(traj, limits, defects)
    return defects


def validate_bytes(data: bytes, limits: ValidationLimits) -> tuple[Trajectory | None, list[Defect]]:
    """Decode and validate a Kafka value; ``(None, [defect])`` if it does not decode."""
    try:
        traj = decode(data, max_bytes=limits.max_record_bytes)
    except DecodeError as exc:
        reason = Reason.OVERSIZE if exc.reason == DecodeReason.OVERSIZE else Reason.DECODE_ERROR
        return None, [Defect(reason, "record", str(exc))]
    return traj, validate(traj, limits)


def _add(defects: list[Defect], reason: Reason, field: str, detail: str) -> None:
    defects.append(Defect(reason, field, detail))


def _check_choice(
    defects: list[Defect], reason: Reason, field: str, value: object, allowed: Collection[str]
) -> bool:
    """Whether ``value`` is one of the ``allowed`` strings; a defect naming them if not."""
    if isinstance(value, str) and value in allowed:
        return True
    _add(defects, reason, field, f"{field} {value!r} is not one of {sorted(allowed)}")
    return False


def _check_arrays(traj: Trajectory, defects: list[Defect]) -> dict[str, np.ndarray]:
    """The array fields that are 1-D numpy arrays of their wire dtype."""
    good: dict[str, np.ndarray] = {}
    for name, dtype in ARRAY_DTYPES.items():
        value = getattr(traj, name)
        if value is None and (name == "logp_old" or name in _TURN_ARRAYS):
            continue
        if not isinstance(value, np.ndarray):
            problem = f"is a {type(value).__name__}"
        elif value.ndim != 1:
            problem = f"has shape {value.shape}"
        elif value.dtype != dtype:
            problem = f"has dtype {value.dtype.name}"
        else:
            good[name] = value
            continue
        _add(defects, Reason.BAD_FIELD, name, f"{name} {problem}, expected 1-D {dtype.name}")
    return good


def _check_identity(traj: Trajectory, limits: ValidationLimits, defects: list[Defect]) -> None:
    for name in _ID_FIELDS:
        value = getattr(traj, name)
        if not isinstance(value, str) or not value:
            _add(
                defects, Reason.BAD_FIELD, name, f"{name} must be a non-empty string, got {value!r}"
            )
        elif (n := len(value.encode("utf-8", "surrogatepass"))) > limits.max_id_bytes:
            _add(
                defects,
                Reason.FIELD_TOO_LONG,
                name,
                f"{name} is {n} bytes ({value[:32]!r}...), limit {limits.max_id_bytes}",
            )
    size, index = traj.group_size, traj.sample_index
    if not _is_int(size) or not 1 <= size <= _INT32_MAX:
        _add(
            defects,
            Reason.BAD_FIELD,
            "group_size",
            f"group_size must be in [1, {_INT32_MAX}], got {size!r}",
        )
    elif size > limits.max_group_size:
        _add(
            defects,
            Reason.BAD_FIELD,
            "group_size",
            f"group_size {size} exceeds max_group_size {limits.max_group_size}",
        )
    elif not _is_int(index) or not 0 <= index < size:
        _add(
            defects,
            Reason.BAD_FIELD,
            "sample_index",
            f"sample_index must be in [0, group_size={size}), got {index!r}",
        )


def _check_scalars(traj: Trajectory, limits: ValidationLimits, defects: list[Defect]) -> None:
    finish = traj.finish_reason
    _check_choice(defects, Reason.BAD_FIELD, "finish_reason", finish, _FINISH_REASONS)
    status = traj.old_logits_status
    known = _check_choice(defects, Reason.BAD_FIELD, "old_logits_status", status, _STATUSES)
    if known and (status in _STATUSES_WITH_LOGITS) != (traj.logp_old is not None):
        has = "present" if traj.logp_old is not None else "absent"
        _add(
            defects,
            Reason.BAD_FIELD,
            "old_logits_status",
            f"old_logits_status {status!r} but logp_old is {has}",
        )
    created, finished = traj.created_at_ms, traj.finished_at_ms
    if not (_is_int(created) and _is_int(finished) and 0 <= created <= finished):
        _add(
            defects,
            Reason.BAD_FIELD,
            "finished_at_ms",
            f"need 0 <= created_at_ms <= finished_at_ms, got {created!r} and {finished!r}",
        )
    if not _is_finite_number(traj.reward):
        _add(defects, Reason.BAD_REWARD, "reward", f"reward must be finite, got {traj.reward!r}")
    if traj.advantage is not None and not _is_finite_number(traj.advantage):
        _add(
            defects,
            Reason.BAD_REWARD,
            "advantage",
            f"advantage must be finite or None, got {traj.advantage!r}",
        )
    details = traj.reward_details
    problem = None if isinstance(details, dict) else f"got a {type(details).__name__}"
    if problem is None:
        try:
            size = len(orjson.dumps(details))
        except TypeError as exc:  # orjson.JSONEncodeError
            problem = str(exc)
        else:
            if size > limits.max_reward_details_bytes:
                _add(
                    defects,
                    Reason.FIELD_TOO_LONG,
                    "reward_details",
                    f"reward_details is {size} bytes as JSON, limit "
                    f"{limits.max_reward_details_bytes}",
                )
    if problem is not None:
        _add(
            defects,
            Reason.BAD_FIELD,
            "reward_details",
            f"reward_details must be a JSON object: {problem}",
        )


def _check_tokens(
    arrays: dict[str, np.ndarray], limits: ValidationLimits, defects: list[Defect]
) -> None:
    prompt, response = arrays.get("prompt_ids"), arrays.get("response_ids")
    if prompt is not None and len(prompt) == 0:
        _add(defects, Reason.BAD_FIELD, "prompt_ids", "prompt_ids is empty")
    if response is not None and len(response) == 0:
        _add(defects, Reason.EMPTY_RESPONSE, "response_ids", "response_ids is empty")
    total = limits.max_total_tokens
    if prompt is not None and response is not None and total is not None:
        n_prompt, n_response = len(prompt), len(response)
        if n_prompt + n_response > total:
            _add(
                defects,
                Reason.TOO_LONG,
                "response_ids",
                f"prompt_ids + response_ids = {n_prompt} + {n_response} tokens, "
                f"the model's context is {total}",
            )
    for name, ids, limit in (
        ("prompt_ids", prompt, limits.max_prompt_tokens),
        ("response_ids", response, limits.max_response_tokens),
    ):
        if ids is None or len(ids) == 0:
            continue
        if len(ids) > limit:
            _add(defects, Reason.TOO_LONG, name, f"{name} has {len(ids)} tokens, limit {limit}")
        vocab = limits.vocab_size
        if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
            out = ids < 0 if vocab is None else (ids < 0) | (ids >= vocab)
            bad = np.flatnonzero(out)
            bound = ">= 0" if vocab is None else f"[0, {vocab})"
            _add(
                defects,
                Reason.TOKEN_OUT_OF_RANGE,
                name,
                f"{name}[{bad[0]}] = {ids[bad[0]]} not in {bound} ({len(bad)} tokens out of range)",
            )


def _check_logprobs(
    arrays: dict[str, np.ndarray], limits: ValidationLimits, defects: list[Defect]
) -> None:
    response = arrays.get("response_ids")
    epsilon = limits.logprob_epsilon
    for name in ("logp_infer", "logp_old"):
        values = arrays.get(name)
        if values is None:
            continue
        if response is not None and len(values) != len(response):
            _add(
                defects,
                Reason.LENGTH_MISMATCH,
                name,
                f"{name} has {len(values)} entries, response_ids has {len(response)}",
            )
        if len(values) == 0:
            continue
        finite = np.isfinite(values)
        if finite.all() and values.max() <= epsilon:
            continue  # the common case, in three cheap array passes
        bad = np.flatnonzero(~finite)
        if bad.size:
            _add(
                defects,
                Reason.NONFINITE_LOGPROB,
                name,
                f"{name}[{bad[0]}] = {values[bad[0]]} ({bad.size} non-finite values)",
            )
        positive = np.flatnonzero(finite & (values > epsilon))
        if positive.size:
            _add(
                defects,
                Reason.POSITIVE_LOGPROB,
                name,
                f"{name}[{positive[0]}] = {values[positive[0]]} > {epsilon} "
                f"({positive.size} positive log-probs)",
            )


def _check_segments(
    arrays: dict[str, np.ndarray], limits: ValidationLimits, defects: list[Defect]
) -> None:
    # A record has a handful of segments: plain Python lists are faster than numpy here.
    versions = arrays["segment_versions"].tolist() if "segment_versions" in arrays else None
    lengths = arrays["segment_lengths"].tolist() if "segment_lengths" in arrays else None
    if versions is not None and lengths is not None and len(versions) != len(lengths):
        _add(
            defects,
            Reason.SEGMENT_MISMATCH,
            "segment_lengths",
            f"{len(versions)} segment_versions but {len(lengths)} segment_lengths",
        )
    if lengths is not None:
        for i, length in enumerate(lengths):
            if length <= 0:
                _add(
                    defects,
                    Reason.SEGMENT_MISMATCH,
                    "segment_lengths",
                    f"segment_lengths[{i}] = {length}, segments must be at least 1 token",
                )
                break
        response = arrays.get("response_ids")
        if response is not None and sum(lengths) != len(response):
            _add(
                defects,
                Reason.LENGTH_MISMATCH,
                "segment_lengths",
                f"segment_lengths sum to {sum(lengths)}, response_ids has {len(response)} tokens",
            )
    if not versions:
        return
    for i in range(1, len(versions)):
        if versions[i] < versions[i - 1]:
            _add(
                defects,
                Reason.SEGMENT_MISMATCH,
                "segment_versions",
                f"segment_versions decrease at index {i}: {versions[i - 1]} -> {versions[i]}",
            )
            break
    low, high = min(versions), max(versions)
    floor = max(0, limits.min_version) if limits.min_version is not None else 0
    if low < floor or (limits.max_version is not None and high > limits.max_version):
        allowed = f"[{floor}, {'∞' if limits.max_version is None else limits.max_version}]"
        _add(
            defects,
            Reason.VERSION_OUT_OF_RANGE,
            "segment_versions",
            f"segment_versions span [{low}, {high}], allowed {allowed}",
        )


def _check_turns(traj: Trajectory, arrays: dict[str, np.ndarray], defects: list[Defect]) -> None:
    """The multi-turn layout: alternating turns from a policy turn, covering the response,
    with segment boundaries only at policy tokens and 0.0 log-probs at env tokens."""
    _check_tool_calls(traj, defects)
    _check_episode_end(traj, defects)
    turns = _turn_arrays(traj, arrays, defects)
    if turns is None:
        return
    lengths_array, kinds_array = turns
    lengths, kinds = lengths_array.tolist(), kinds_array.tolist()
    if len(lengths) != len(kinds):
        _add(
            defects,
            Reason.TURN_MISMATCH,
            "turn_kinds",
            f"{len(lengths)} turn_lengths but {len(kinds)} turn_kinds",
        )
        return
    response = arrays.get("response_ids")
    _check_turn_coverage(lengths, response, defects)
    _check_turn_lengths(lengths, defects)
    if not _check_turn_kinds(kinds, defects):
        return
    _check_turn_alternation(kinds, traj.episode_end, defects)
    covered = response is not None and sum(lengths) == len(response)
    if not covered or any(length <= 0 for length in lengths):
        return  # positions are meaningless without a layout that covers the response
    env = np.repeat(kinds_array != TurnKind.POLICY, lengths_array)
    if env.any():
        _check_env_logprobs(arrays, env, defects)
        _check_env_segment_starts(arrays, env, defects)


def _check_tool_calls(traj: Trajectory, defects: list[Defect]) -> None:
    tool_calls = traj.tool_calls
    if not _is_int(tool_calls) or not 0 <= tool_calls <= _INT32_MAX:
        _add(
            defects,
            Reason.BAD_TOOL_CALLS,
            "tool_calls",
            f"tool_calls must be in [0, {_INT32_MAX}], got {tool_calls!r}",
        )


def _check_episode_end(traj: Trajectory, defects: list[Defect]) -> None:
    end = traj.episode_end
    _check_choice(defects, Reason.UNKNOWN_EPISODE_END, "episode_end", end, _EPISODE_ENDS)


def _turn_arrays(
    traj: Trajectory, arrays: dict[str, np.ndarray], defects: list[Defect]
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(turn_lengths, turn_kinds)`` to check further, or None: a single policy turn,
    only one of the two present (a defect), or an array of the wrong dtype."""
    if (traj.turn_lengths is None) != (traj.turn_kinds is None):
        _add(
            defects,
            Reason.TURN_MISMATCH,
            "turn_kinds",
            "turn_lengths and turn_kinds must both be arrays or both None",
        )
        return None
    if traj.turn_lengths is None:  # the canonical single policy turn
        return None  # tool_calls may count a call whose observation ended the episode
    lengths, kinds = arrays.get("turn_lengths"), arrays.get("turn_kinds")
    if lengths is None or kinds is None:
        return None  # a wrong dtype, reported by _check_arrays
    return lengths, kinds


def _check_turn_coverage(
    lengths: list[int], response: np.ndarray | None, defects: list[Defect]
) -> None:
    if response is not None and sum(lengths) != len(response):
        _add(
            defects,
            Reason.TURN_MISMATCH,
            "turn_lengths",
            f"turn_lengths sum to {sum(lengths)}, response_ids has {len(response)} tokens",
        )


def _check_turn_lengths(lengths: list[int], defects: list[Defect]) -> None:
    short = [i for i, length in enumerate(lengths) if length <= 0]
    if short:
        _add(
            defects,
            Reason.EMPTY_TURN,
            "turn_lengths",
            f"turn_lengths[{short[0]}] = {lengths[short[0]]}, turns must be at least 1 token",
        )


def _check_turn_kinds(kinds: list[int], defects: list[Defect]) -> bool:
    """Whether every turn kind is known (the order checks need known kinds)."""
    known = {int(kind) for kind in TurnKind}
    unknown = [i for i, kind in enumerate(kinds) if kind not in known]
    if unknown:
        _add(
            defects,
            Reason.UNKNOWN_TURN_KIND,
            "turn_kinds",
            f"turn_kinds[{unknown[0]}] = {kinds[unknown[0]]}, expected one of "
            f"{sorted(known)} (POLICY, ENV)",
        )
    return not unknown


def _check_turn_alternation(kinds: list[int], end: object, defects: list[Defect]) -> None:
    """An episode starts with a policy turn, alternates, and says why it ended."""
    if kinds and kinds[0] != TurnKind.POLICY:
        _add(
            defects,
            Reason.FIRST_TURN_NOT_POLICY,
            "turn_kinds",
            "turn_kinds[0] is ENV: an episode starts with a policy turn",
        )
    repeats = [i for i in range(1, len(kinds)) if kinds[i] == kinds[i - 1]]
    if repeats:
        i = repeats[0]
        _add(
            defects,
            Reason.ADJACENT_SAME_KIND,
            "turn_kinds",
            f"turn_kinds[{i - 1}] and turn_kinds[{i}] are both {TurnKind(kinds[i]).name}: "
            "turns alternate",
        )
    if len(kinds) > 1 and end == EpisodeEnd.NONE:
        _add(
            defects,
            Reason.EPISODE_END_MISMATCH,
            "episode_end",
            f"a record of {len(kinds)} turns needs an episode_end",
        )


def _check_env_logprobs(
    arrays: dict[str, np.ndarray], env: np.ndarray, defects: list[Defect]
) -> None:
    """Log-probs are exactly 0.0 at environment tokens (``env``: one flag per response
    token)."""
    for name in ("logp_infer", "logp_old"):
        values = arrays.get(name)
        if values is None or len(values) != len(env):
            continue
        # Bitwise: -0.0 or a NaN is not the 0.0 the format promises at env positions.
        bad = np.flatnonzero(env & (values.view(np.uint32) != 0))
        if bad.size:
            _add(
                defects,
                Reason.ENV_LOGPROB_NONZERO,
                name,
                f"{name}[{bad[0]}] = {values[bad[0]]} at an environment token, expected 0.0 "
                f"({bad.size} such tokens)",
            )


def _check_env_segment_starts(
    arrays: dict[str, np.ndarray], env: np.ndarray, defects: list[Defect]
) -> None:
    """No segment starts inside an environment turn (``env``: one flag per response
    token)."""
    seg_lengths = arrays.get("segment_lengths")
    if seg_lengths is not None and len(seg_lengths) > 1 and (seg_lengths > 0).all():
        starts = np.cumsum(seg_lengths)[:-1]
        inside = starts[(starts < len(env))]
        bad_starts = inside[env[inside]]
        if bad_starts.size:
            _add(
                defects,
                Reason.SEGMENT_IN_ENV_TURN,
                "segment_lengths",
                f"segment_lengths start a segment at response token {bad_starts[0]}, inside an "
                "environment turn: an env turn belongs to the segment of the policy token "
                "before it",
            )


def _check_policies(traj: Trajectory, arrays: dict[str, np.ndarray], defects: list[Defect]) -> None:
    """``policy`` and ``turn_policies``: well-formed names, one per turn, each policy turn
    the record's own policy, each env turn the environment or another policy."""
    policy, owners = traj.policy, traj.turn_policies
    good_policy = isinstance(policy, str) and POLICY_NAME.fullmatch(policy) is not None
    if not good_policy:
        _add(
            defects,
            Reason.BAD_POLICY,
            "policy",
            f"policy {policy!r} is not a policy name ({POLICY_NAME.pattern}, '' for the "
            "run's single policy)",
        )
    if owners is None:
        return
    if not isinstance(owners, tuple):
        _add(
            defects,
            Reason.BAD_POLICY,
            "turn_policies",
            f"turn_policies must be a tuple of policy names or None, got a {type(owners).__name__}",
        )
        return
    bad = [
        i
        for i, name in enumerate(owners)
        if not isinstance(name, str) or POLICY_NAME.fullmatch(name) is None
    ]
    if bad:
        _add(
            defects,
            Reason.BAD_POLICY,
            "turn_policies",
            f"turn_policies[{bad[0]}] = {owners[bad[0]]!r} is not a policy name "
            f"({POLICY_NAME.pattern}; {len(bad)} such entries)",
        )
        return
    if traj.turn_lengths is None:
        _add(
            defects,
            Reason.TURN_POLICY_MISMATCH,
            "turn_policies",
            f"turn_policies has {len(owners)} entries but the record has no turns "
            "(turn_lengths is None): per-turn provenance needs turns",
        )
        return
    lengths, kinds = arrays.get("turn_lengths"), arrays.get("turn_kinds")
    if lengths is None:
        return  # a wrong dtype, reported by _check_arrays
    if len(owners) != len(lengths):
        _add(
            defects,
            Reason.TURN_POLICY_MISMATCH,
            "turn_policies",
            f"turn_policies has {len(owners)} entries, turn_lengths has {len(lengths)} turns",
        )
        return
    if kinds is None or len(kinds) != len(owners) or not good_policy:
        return  # reported by _check_turns (or above)
    wrong: list[tuple[int, str]] = []
    for i, (kind, name) in enumerate(zip(kinds.tolist(), owners, strict=True)):
        if kind == TurnKind.POLICY and name != policy:
            wrong.append((i, f"names {name!r} on a POLICY turn, the record's policy is {policy!r}"))
        elif kind == TurnKind.ENV and name and name == policy:
            wrong.append((i, f"names the record's own policy {name!r} on an ENV turn"))
    if wrong:
        i, problem = wrong[0]
        _add(
            defects,
            Reason.TURN_POLICY_MISMATCH,
            "turn_policies",
            f"turn_policies[{i}] {problem} ({len(wrong)} such turns)",
        )


def _check_size(traj: Trajectory, limits: ValidationLimits, defects: list[Defect]) -> None:
    try:
        size = encoded_size(traj)
    except ValueError as exc:
        if not defects:  # a record that passes validation must be encodable
            _add(defects, Reason.BAD_FIELD, "record", f"record cannot be encoded: {exc}")
        return
    if size > limits.max_record_bytes:
        _add(
            defects,
            Reason.OVERSIZE,
            "record",
            f"record encodes to {size} bytes, limit {limits.max_record_bytes}",
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    is_number = isinstance(value, int | float | np.integer | np.floating)
    return is_number and not isinstance(value, bool) and math.isfinite(value)
