"""The stream bounds what a record can make it hold or emit: a record claiming a group over
``[streams.validation] max_group_size`` or carrying an id over its bound is dead-lettered
with the reason and never opens a group state; an invalid record changes no group; and a
scored group its topic would refuse is dead-lettered instead of failing every replay."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError
from support.streams import FILLING, RUN, Harness, filling_tokens, synthetic

from schemas.codec import encode
from schemas.group import decode_group
from schemas.topics import ROLLOUTS_SCORED
from schemas.validation import MAX_GROUP_SIZE_LIMIT, MAX_ID_BYTES
from streams.config import StreamsConfig
from streams.groups import GROUP_PREFIX, GroupState, group_key


def test_a_record_claiming_a_group_over_the_bound_is_dead_lettered_with_its_reason() -> None:
    h = Harness()
    h.sample(group_id="huge", group_size=2**31 - 1, sample_index=0)
    h.sample(group_id="big", group_size=5000, sample_index=3)
    letters = h.dead_letters()
    assert [d.reason for d in letters] == ["bad_field", "bad_field"]
    assert "group_size 5000 exceeds max_group_size 1024" in letters[1].detail
    assert not any(k.startswith(GROUP_PREFIX) for k in h.table)  # no group state opened
    h.sample(group_id="ok", group_size=1024, sample_index=0)  # at the bound: accepted
    assert len(h.dead_letters()) == 2 and any(k.startswith(GROUP_PREFIX) for k in h.table)


def test_the_bound_is_configurable_and_an_invalid_sample_over_it_opens_no_group() -> None:
    h = Harness(validation={"max_group_size": 4})
    h.sample(group_id="g", group_size=8, sample_index=0)
    (letter,) = h.dead_letters()
    assert "max_group_size 4" in letter.detail
    # Invalid for another reason too (a bad finish reason): still no group to account it in.
    bad = dataclasses.replace(
        synthetic(run_id=RUN, group_id="g2", group_size=8), finish_reason="bogus"
    )
    h.feed(encode(bad), b"g2")
    assert not any(k.startswith(GROUP_PREFIX) for k in h.table)
    for i in range(4):
        h.sample(group_id="g4", group_size=4, sample_index=i)
    assert len(h.on("rollouts.scored")) == 1


@pytest.mark.parametrize("value", [0, -1, "many", 1.5, 2**31])
def test_max_group_size_setting_is_validated(value: object) -> None:
    with pytest.raises(ValidationError, match="max_group_size"):
        StreamsConfig.model_validate({"validation": {"max_group_size": value}})


def test_a_group_id_just_under_the_codecs_limit_is_dead_lettered_and_the_worker_goes_on() -> None:
    """60,000 bytes of group id encode (the codec allows 65,535), but the scored group would
    repeat it in its key, a header, its meta and each sample: it is refused on arrival."""
    h = Harness()
    long_id = "g" * 60_000
    for i in range(4):
        h.sample(group_id=long_id, sample_index=i)
    letters = h.dead_letters()
    assert [d.reason for d in letters] == ["field_too_long"] * 4
    assert "group_id is 60000 bytes" in letters[0].detail and "limit 256" in letters[0].detail
    assert not any(k.startswith(GROUP_PREFIX) for k in h.table)
    at_bound = "b" * (MAX_ID_BYTES - 2)  # its trajectory ids ("<group id>-<i>") at the bound
    for i in range(4):
        h.sample(group_id=at_bound, sample_index=i)
    (out,) = h.on("rollouts.scored")
    assert out.key == at_bound.encode() and decode_group(out.value).complete


def test_an_invalid_record_keyed_like_a_real_group_leaves_the_group_alone() -> None:
    """A record that fails validation but names a real group, with ``group_size=1``, used to
    be counted as that group's dropped sample: the group closed empty at once and its four
    genuine samples were dead-lettered as late."""
    h = Harness()
    forged = dataclasses.replace(
        synthetic(run_id=RUN, group_id="real", group_size=1, sample_index=0),
        trajectory_id="forged",
        finish_reason="bogus",
    )
    h.feed(encode(forged), b"real")
    for i in range(4):
        h.sample(group_id="real", sample_index=i)
    assert [d.reason for d in h.dead_letters()] == ["bad_field"]  # the forged record alone
    (out,) = h.on("rollouts.scored")
    group = decode_group(out.value)
    assert group.complete and [s.sample_index for s in group.samples] == [0, 1, 2, 3]


def test_a_group_too_large_for_its_topic_is_dead_lettered_before_it_is_sent() -> None:
    """A scored group whose value fits 16 MiB but whose record (key, headers, batch framing)
    does not would be refused by the broker at every replay of its step; the stream
    dead-letters its samples as ``group_too_large`` instead, and goes on."""
    tokens, room = filling_tokens("probe")
    h = Harness(**FILLING)
    for i in range(5):
        h.sample(group_id="probe", group_size=5, sample_index=i, response_len=tokens)
    assert h.on("rollouts.scored") == []
    letters = h.dead_letters()
    assert [d.reason for d in letters] == ["group_too_large"] * 5
    value_size = int(letters[0].detail.split("group would be ")[1].split(" ")[0])
    assert room < value_size <= ROLLOUTS_SCORED.max_message_bytes  # fits the naive check
    assert GroupState.from_bytes(h.table[group_key("probe")]).outcome == "failed"
    h.sample(group_id="next", sample_index=0)  # the worker goes on
    for i in range(1, 4):
        h.sample(group_id="next", sample_index=i)
    assert [decode_group(s.value).group_id for s in h.on("rollouts.scored")] == ["next"]


@pytest.mark.parametrize("value", [MAX_GROUP_SIZE_LIMIT + 1, 10**9])
def test_a_max_group_size_above_the_limit_is_refused_with_why(value: int) -> None:
    with pytest.raises(ValidationError, match=f"max_group_size {value} is above 4096"):
        StreamsConfig.model_validate({"validation": {"max_group_size": value}})
    limit = StreamsConfig.model_validate({"validation": {"max_group_size": MAX_GROUP_SIZE_LIMIT}})
    assert limit.validation.max_group_size == MAX_GROUP_SIZE_LIMIT
