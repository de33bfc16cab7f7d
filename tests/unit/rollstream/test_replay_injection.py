"""``rollstream replay`` prints what a record says, literally: a field holding Rich markup
or a terminal escape sequence (a hyperlink, a screen clear) neither crashes the printer
nor reaches the terminal as anything but text."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from rich.console import Console
from support.replay import EVIL, T0, assert_literal, scored_group
from support.streams import synthetic

from rollstream.debug.records import ReplayRecord, decode_record
from rollstream.debug.render import Renderer, RenderOptions
from schemas.codec import encode
from schemas.control import DeadLetter, VersionAnnouncement

_SGR = re.compile(r"\x1b\[[0-9;]*m")


def _render(record: ReplayRecord) -> str:
    out = io.StringIO()
    console = Console(
        file=out, force_terminal=True, width=2000, color_system="truecolor", highlight=False
    )
    Renderer(RenderOptions(tokenizer="tiny"), console).record(record)
    return _SGR.sub("", out.getvalue())  # Rich's own styling; anything else stays


@pytest.mark.parametrize("evil", EVIL, ids=["link", "close-all", "close-bold", "osc8", "clear"])
def test_every_record_field_renders_literally(evil: str) -> None:
    letter = DeadLetter(evil, f"detail {evil}", f"topic{evil}", 0, 1)
    traj = dataclasses.replace(
        synthetic(group_id="g", sample_index=0),
        run_id=evil,
        trajectory_id=f"t{evil}",
        group_id=evil,
        task=evil,
        producer_id=evil,
        region=evil,
        finish_reason=evil,
        episode_end=evil,
    )
    record = decode_record("dlq", 0, 5, T0, evil.encode(), encode(synthetic()), [letter.header()])
    record = dataclasses.replace(record, trajectory=traj, notes=(evil,), error=evil)
    text = _render(record)
    assert "dead letter" in text
    for field in (evil, f"detail {evil}", f"topic{evil}", f"t{evil}"):
        assert_literal(text, field)

    group = scored_group(evil, [1, 2], [0, 0])  # its samples' trajectory ids hold it too
    text = _render(dataclasses.replace(record, trajectory=None, group=group))
    assert_literal(text, f"scored group {evil}")
    assert_literal(text, f"{evil}-1")

    note = VersionAnnouncement(evil, 2, f"s3://b/{evil}", None, 2, "0" * 64, 10, T0)
    text = _render(dataclasses.replace(record, trajectory=None, announcement=note))
    assert_literal(text, evil)


@pytest.mark.parametrize(
    "char", ["\u2028", "\u2029", "\u200e", "\u200f", "\u202e", "\u2066", "\u200b", "\x85"]
)
def test_separators_and_direction_marks_render_as_escapes(char: str) -> None:
    """A line separator breaks the printed line where the record has none; a direction
    mark or override reorders what follows it. Each is shown as its escape."""
    evil = f"safe{char}txt.exe"
    letter = DeadLetter(evil, "detail", "topic", 0, 1)
    record = decode_record("dlq", 0, 5, T0, evil.encode(), encode(synthetic()), [letter.header()])
    text = _render(dataclasses.replace(record, error=evil))
    assert char not in text
    assert f"safe{char.encode('unicode_escape').decode()}txt.exe" in text
