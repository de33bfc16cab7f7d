"""Control messages refuse garbage: wrong types, out-of-range values, unknown fields and
oversized input, each error naming the field; and a good message round-trips."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.control import (
    MAX_MESSAGE_BYTES,
    DeadLetter,
    FilteredGroup,
    PromptStats,
    RoleHeartbeat,
    StaleRecord,
    VersionAnnouncement,
)

GOOD: dict[type, dict[str, Any]] = {
    VersionAnnouncement: {
        "run": "run-7",
        "version": 12,
        "uri": "s3://b/weights/run-7/v12/",
        "parent": 11,
        "base": 10,
        "sha256": "ab" * 32,
        "bytes": 1,
        "published_at_ms": 1,
        "groups_per_step": 4,
        "max_staleness": 2,
        "producers": 3,
    },
    DeadLetter: {
        "reason": "bad_field",
        "detail": "",
        "source_topic": "rollouts.raw",
        "partition": 0,
        "offset": 9,
    },
    StaleRecord: {"trajectory_id": "t", "staleness": 5, "trainer_version": 9, "max_staleness": 4},
    FilteredGroup: {"group_id": "g", "operator": "solved", "reason": "all passed"},
    PromptStats: {
        "run_id": "r",
        "prompt_key": "k",
        "partition": 1,
        "samples": 4,
        "passes": 2,
        "reward_sum": 2.5,
        "last_version": -1,
    },
    RoleHeartbeat: {
        "run": "r",
        "role": "trainer",
        "instance": "i",
        "host": "h",
        "pid": 7,
        "state": "up",
        "at_ms": 5,
        "interval_s": 2.0,
        "detail": {"groups": 3},
    },
}


class NotJson:
    """A value JSON cannot carry, with the same test id in every process."""

    def __repr__(self) -> str:
        return "<not JSON>"


# (message, field, bad value): a wrong type or a value out of its declared range
# fmt: off
BAD_VALUES: list[tuple[type, str, object]] = [
    (VersionAnnouncement, "version", -1),
    (VersionAnnouncement, "version", 12.0),
    (VersionAnnouncement, "uri", ""),
    (VersionAnnouncement, "sha256", "ab" * 32 + "\n"),
    (VersionAnnouncement, "groups_per_step", 1_000_001),
    (VersionAnnouncement, "max_staleness", "2"),
    (VersionAnnouncement, "producers", 4 * 3 + 1),  # more than the pace allows
    (VersionAnnouncement, "signature", "not base64!"),
    (DeadLetter, "reason", ""),
    (DeadLetter, "detail", None),
    (DeadLetter, "partition", -1),
    (DeadLetter, "offset", True),
    (DeadLetter, "offset", 2**63),  # beyond what the message could be sent as
    (StaleRecord, "staleness", 1.5),
    (StaleRecord, "staleness", -(2**63) - 1),
    (StaleRecord, "stage", "elsewhere"),
    (FilteredGroup, "operator", 3),
    (PromptStats, "samples", 0),
    (PromptStats, "passes", 5),  # more passes than samples
    (PromptStats, "reward_sum", "2.5"),
    (PromptStats, "last_version", -2),
    (RoleHeartbeat, "role", "gateway"),
    (RoleHeartbeat, "state", "down"),
    (RoleHeartbeat, "interval_s", 0.0),
    (RoleHeartbeat, "interval_s", float("nan")),
    (RoleHeartbeat, "detail", {"k": NotJson()}),
    (RoleHeartbeat, "detail", [1]),
]
# fmt: on


@pytest.mark.parametrize("cls", list(GOOD), ids=lambda cls: cls.__name__)
def test_a_good_message_round_trips(cls: type) -> None:
    message = cls(**GOOD[cls])
    assert cls.from_json(message.to_json()) == message
    assert cls.from_json(message.to_json().decode()) == message


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    BAD_VALUES,
    ids=[f"{cls.__name__}.{field}={value!r}" for cls, field, value in BAD_VALUES],
)
def test_a_wrong_type_or_range_is_refused_naming_the_field(
    cls: type, field: str, value: object
) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**{**GOOD[cls], field: value})
    try:
        data = orjson.dumps({**GOOD[cls], field: value})
    except TypeError:
        return  # not JSON: only a caller in the process can hand it over
    with pytest.raises(ValueError, match=field):
        cls.from_json(data)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(cls(**GOOD[cls]), **{field: value})


@pytest.mark.parametrize("cls", list(GOOD), ids=lambda cls: cls.__name__)
def test_unknown_missing_and_oversized_input_is_refused(cls: type) -> None:
    with pytest.raises(ValueError, match="surplus"):
        cls.from_json(orjson.dumps({**GOOD[cls], "surplus": 1}))
    first = next(iter(GOOD[cls]))
    without = {k: v for k, v in GOOD[cls].items() if k != first}
    with pytest.raises(ValueError, match=first):
        cls.from_json(orjson.dumps(without))
    padded = orjson.dumps(GOOD[cls])[:-1] + b" " * MAX_MESSAGE_BYTES + b"}"
    with pytest.raises(ValueError, match=f"{cls.__name__}: .* bytes, limit"):
        cls.from_json(padded)


JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)  # what a JSON writer (orjson) sends
    | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(GOOD)), st.data(), JUNK)
def test_any_value_in_any_field_is_a_message_or_a_value_error(
    cls: type, data: st.DataObject, junk: object
) -> None:
    """Whatever JSON arrives in a field, parsing gives a message that round-trips, or a
    ValueError: never another exception."""
    field = data.draw(st.sampled_from(sorted(GOOD[cls])))
    try:
        message = cls.from_json(orjson.dumps({**GOOD[cls], field: junk}))
    except ValueError:
        return
    assert cls.from_json(message.to_json()) == message


@pytest.mark.parametrize("junk", [b"", b"{", b"[1]", b"null", b"7", "\xff", b'"s"'])
def test_input_that_is_not_an_object_is_refused(junk: bytes | str) -> None:
    for cls in GOOD:
        with pytest.raises(ValueError, match=cls.__name__):
            cls.from_json(junk)
