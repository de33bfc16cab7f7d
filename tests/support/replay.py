"""Records for the replay tests: a scored group with exact old logits at fixed times, and
field values a terminal must print as text (Rich markup, escape sequences)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from schemas.group import ScoredGroup
from streams.groups import GroupState, SampleEntry, build_scored_group
from support.streams import synthetic

T0 = 1_750_000_000_000  # record timestamps (ms), fixed so time ranges are exact


def scored_group(group_id: str, versions: Sequence[int], staleness: Sequence[int]) -> ScoredGroup:
    """A group whose samples carry exact logp_old (logp_infer plus small noise)."""
    samples = []
    rng = np.random.default_rng(len(group_id))
    for i, version in enumerate(versions):
        traj = synthetic(
            run_id="run",
            group_id=group_id,
            group_size=len(versions),
            sample_index=i,
            versions=(version,),
            reward=float(i) / max(len(versions) - 1, 1),
            seed=i + 7,
        )
        noisy = np.minimum(traj.logp_infer + rng.normal(0, 0.3, len(traj.logp_infer)), 0.0)
        samples.append(traj.with_old_logits(noisy))
    state = GroupState(
        group_id,
        0,
        T0,
        len(samples),
        tuple(
            SampleEntry(t.trajectory_id, t.sample_index, s, i)
            for i, (t, s) in enumerate(zip(samples, staleness, strict=True))
        ),
    )
    return build_scored_group("run", state, samples, trainer_version=9, now_ms=T0)


OSC8 = "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\"
EVIL = [
    "[link=file:///etc/passwd]x[/link]",
    "bad[/][/]",
    "[/bold]",
    OSC8,
    "\x1b[2Jcleared",
]


def assert_literal(text: str, evil: str) -> None:
    assert "\x1b]8" not in text, "a terminal hyperlink reached the output"
    assert "\x1b[2J" not in text, "a raw escape sequence reached the output"
    if "\x1b" in evil:
        assert evil.replace("\x1b", "\\x1b") in text
    else:
        assert evil in text
