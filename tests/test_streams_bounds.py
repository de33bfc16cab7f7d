"""The stream bounds a group by ``[streams.validation] max_group_size``: a record claiming a
larger group is dead-lettered with the reason, and never opens a group state that every
later sample would rewrite in full."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError
from support.streams import synthetic

from schemas.codec import encode
from streams.config import StreamsConfig
from streams.groups import GROUP_PREFIX
from tests.test_streams_logic import RUN, Harness


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
