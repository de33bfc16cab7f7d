"""Group assembly state as it lives in the Faust table (and its changelog), and emission.

Table layout (keys and values are bytes; the changelog is co-partitioned with
``rollouts.raw``, so a group's state lives in the partition its samples arrive on):

- ``g:<group_id>`` → ``GroupState`` as orjson: partition, when the first sample was seen,
  the expected group size, the samples received (trajectory id, sample index, staleness,
  source offset), the samples dropped on the way (stale, or a version never published),
  and once closed, when and how (a marker kept ``emitted_retention_s`` so that a late
  sample is refused instead of starting a second copy of the group);
- ``s:<group_id>\\0<trajectory_id>`` → the sample's original record bytes, deleted when
  the group closes;
- ``o:<topic>\\0<partition>`` → the last source offset whose effects are in the table:
  replaying a message at or below it is a no-op (see ``streams.faust.txn``).

``build_scored_group`` turns the samples, once old logits are attached, into the
``ScoredGroup`` that goes to ``rollouts.scored``, with GRPO advantages from
``core.advantages``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import orjson

from core.advantages import group_advantages
from schemas.group import SampleDiagnostics, ScoredGroup
from schemas.trajectory import Trajectory

GROUP_PREFIX = b"g:"
SAMPLE_PREFIX = b"s:"
OFFSET_PREFIX = b"o:"
PROMPT_PREFIX = b"p:"


def group_key(group_id: str) -> bytes:
    return GROUP_PREFIX + group_id.encode()


def sample_key(group_id: str, trajectory_id: str) -> bytes:
    return SAMPLE_PREFIX + group_id.encode() + b"\0" + trajectory_id.encode()


def prompt_stats_key(partition: int, prompt: str) -> bytes:
    """Running statistics of one prompt in one partition (``PromptStats``)."""
    return PROMPT_PREFIX + str(partition).encode() + b"\0" + prompt.encode()


def offset_key(topic: str, partition: int) -> bytes:
    return OFFSET_PREFIX + topic.encode() + b"\0" + str(partition).encode()


@dataclasses.dataclass(frozen=True, slots=True)
class SampleEntry:
    """A received sample: where it came from and how stale it was on arrival."""

    trajectory_id: str
    sample_index: int
    staleness: int
    offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class GroupState:
    """One group's assembly state (immutable: every change is a new value)."""

    group_id: str
    partition: int
    first_seen_ms: int
    group_size: int | None = None
    samples: tuple[SampleEntry, ...] = ()
    dropped: tuple[str, ...] = ()
    closed_ms: int | None = None
    outcome: str | None = None  # complete | partial | dropped

    @property
    def closed(self) -> bool:
        return self.closed_ms is not None

    @property
    def accounted(self) -> int:
        """Samples received or known to have been dropped on the way."""
        return len(self.samples) + len(self.dropped)

    @property
    def ready(self) -> bool:
        """Every sample of the group has arrived or been dropped."""
        return not self.closed and self.group_size is not None and self.accounted >= self.group_size

    def has(self, trajectory_id: str) -> bool:
        return trajectory_id in self.dropped or any(
            s.trajectory_id == trajectory_id for s in self.samples
        )

    def with_sample(self, entry: SampleEntry, group_size: int) -> GroupState:
        return dataclasses.replace(self, group_size=group_size, samples=(*self.samples, entry))

    def with_dropped(self, trajectory_id: str, group_size: int | None) -> GroupState:
        size = self.group_size if self.group_size is not None else group_size
        return dataclasses.replace(self, group_size=size, dropped=(*self.dropped, trajectory_id))

    def closed_as(self, outcome: str, now_ms: int) -> GroupState:
        """The marker left after closing: no samples, just when and how."""
        return dataclasses.replace(self, samples=(), dropped=(), closed_ms=now_ms, outcome=outcome)

    def to_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "group_id": self.group_id,
                "partition": self.partition,
                "first_seen_ms": self.first_seen_ms,
                "group_size": self.group_size,
                "samples": [
                    [s.trajectory_id, s.sample_index, s.staleness, s.offset] for s in self.samples
                ],
                "dropped": list(self.dropped),
                "closed_ms": self.closed_ms,
                "outcome": self.outcome,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupState:
        obj: dict[str, Any] = orjson.loads(data)
        return cls(
            group_id=obj["group_id"],
            partition=obj["partition"],
            first_seen_ms=obj["first_seen_ms"],
            group_size=obj["group_size"],
            samples=tuple(SampleEntry(*row) for row in obj["samples"]),
            dropped=tuple(obj["dropped"]),
            closed_ms=obj["closed_ms"],
            outcome=obj["outcome"],
        )


def build_scored_group(
    run_id: str,
    state: GroupState,
    samples: Sequence[Trajectory],
    *,
    trainer_version: int,
    now_ms: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> ScoredGroup:
    """The emitted record: samples sorted by index, each with its advantage.

    ``samples`` are the group's trajectories with ``logp_old`` already attached (any
    order); their staleness comes from ``state``.
    """
    staleness = {s.trajectory_id: s.staleness for s in state.samples}
    ordered = sorted(samples, key=lambda t: (t.sample_index, t.trajectory_id))
    if ordered:
        adv = group_advantages([t.reward for t in ordered], normalize_std=normalize_std, eps=eps)
        with_adv = tuple(
            t.with_advantage(float(a)) for t, a in zip(ordered, adv.advantages, strict=True)
        )
        mean, std = float(adv.group_mean[0]), float(adv.group_std[0])
    else:
        with_adv, mean, std = (), math.nan, math.nan
    assert state.group_size is not None
    return ScoredGroup(
        run_id=run_id,
        group_id=state.group_id,
        group_size=state.group_size,
        trainer_version_seen=trainer_version,
        samples=with_adv,
        diagnostics=tuple(
            SampleDiagnostics.of(t, staleness.get(t.trajectory_id, -1)) for t in with_adv
        ),
        reward_mean=mean,
        reward_std=std,
        complete=len(with_adv) == state.group_size,
        emitted_at_ms=now_ms,
    )
