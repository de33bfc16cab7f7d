"""Every Kafka topic rollstream uses, declared in one place.

Sizes: ``rollouts.raw`` takes messages up to 8 MiB, twice the stream's record limit
(``schemas.codec.MAX_RECORD_BYTES``, 4 MiB): a record between the two reaches the stream
and is dead-lettered as ``oversize`` with its bytes, instead of being refused by the
broker where nobody sees it. ``rollouts.dlq`` and ``rollouts.stale`` are larger than every
topic they receive from. Each spec's ``max_message_bytes`` is the one size of its topic:
the topic is created with it (``max.message.bytes``, so a cluster's 1 MB default never
applies) and every producer writing the topic allows it (``producer_limits``), since
librdkafka's own default (1 MB) would refuse a large record on the client.

Partitioning: ``rollouts.raw`` is keyed by group id so all samples of a GRPO group land
in one partition (one stream worker assembles the group); ``policy.versions`` is
compacted and keyed by run id, so its latest value per run is the current version.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

MIB = 1024 * 1024
DAY_MS = 24 * 60 * 60 * 1000


@dataclass(frozen=True)
class TopicSpec:
    """Name, partition count and the topic-level configs rollstream relies on."""

    name: str
    partitions: int
    cleanup_policy: str = "delete"  # "delete" or "compact"
    retention_ms: int = 7 * DAY_MS  # -1 keeps forever
    max_message_bytes: int = 8 * MIB
    extra_configs: dict[str, str] = field(default_factory=dict)

    def configs(self) -> dict[str, str]:
        """Topic configs as Kafka names them; compared against an existing topic."""
        configs = {
            "cleanup.policy": self.cleanup_policy,
            "max.message.bytes": str(self.max_message_bytes),
        }
        if self.cleanup_policy == "delete":
            configs["retention.ms"] = str(self.retention_ms)
        configs.update(self.extra_configs)
        return configs


ROLLOUTS_RAW = TopicSpec("rollouts.raw", partitions=8)
ROLLOUTS_SCORED = TopicSpec("rollouts.scored", partitions=4, max_message_bytes=16 * MIB)
ROLLOUTS_DLQ = TopicSpec(
    "rollouts.dlq",
    partitions=1,
    retention_ms=30 * DAY_MS,
    # Whatever reached raw (8 MiB) or scored (16 MiB) must fit here with its original
    # bytes and the rs-dead-letter header, or dead-lettering it would fail.
    max_message_bytes=ROLLOUTS_SCORED.max_message_bytes + 1 * MIB,
)
ROLLOUTS_STALE = TopicSpec(
    "rollouts.stale",
    partitions=4,
    retention_ms=30 * DAY_MS,
    # the trainer routes whole scored groups here (16 MiB) with an rs-stale header
    max_message_bytes=ROLLOUTS_SCORED.max_message_bytes + 1 * MIB,
)
ROLLOUTS_FILTERED = TopicSpec(
    "rollouts.filtered",
    partitions=4,
    retention_ms=30 * DAY_MS,
    # a filtered group's samples keep their raw bytes plus the rs-filtered header
    max_message_bytes=ROLLOUTS_RAW.max_message_bytes + 1 * MIB,
)


def control_topic(name: str) -> TopicSpec:
    """A small compacted topic whose latest value per key is the current state; segments
    roll hourly and compaction may act at once, so old values do not linger."""
    return TopicSpec(
        name,
        partitions=1,
        cleanup_policy="compact",
        max_message_bytes=1 * MIB,
        extra_configs={"min.compaction.lag.ms": "0", "segment.ms": str(60 * 60 * 1000)},
    )


def stream_changelog(name: str, partitions: int) -> TopicSpec:
    """The stream's group table changelog (a Faust internal topic): every accepted sample
    is written to it with its raw bytes, so it takes what raw takes plus the table key."""
    return TopicSpec(
        name,
        partitions=partitions,
        cleanup_policy="compact",
        max_message_bytes=ROLLOUTS_RAW.max_message_bytes + 1 * MIB,
    )


def largest_message(*specs: TopicSpec) -> int:
    """The largest record a producer writing the topics of ``specs`` must accept."""
    return max(spec.max_message_bytes for spec in specs)


RECORD_OVERHEAD_BYTES = 128
"""What a one-record batch takes beyond the record's key, value and headers, rounded up:
the v2 batch header (61 bytes) and the record's varint framing (at most 36)."""

HEADER_OVERHEAD_BYTES = 10
"""A header's framing beyond its key and value: their two varint lengths."""


def value_room(spec: TopicSpec, key: bytes | None, headers: Iterable[tuple[str, bytes]]) -> int:
    """The largest value a record with ``key`` and ``headers`` may have in ``spec``'s topic:
    the broker compares ``max.message.bytes`` with the whole batch, so a value sized up to
    the limit alone is refused (and would be again on every retry)."""
    framing = sum(len(k.encode()) + len(v) + HEADER_OVERHEAD_BYTES for k, v in headers)
    return spec.max_message_bytes - RECORD_OVERHEAD_BYTES - len(key or b"") - framing


def producer_limits(*specs: TopicSpec) -> dict[str, str]:
    """librdkafka settings for a producer writing the topics of ``specs``: it accepts a
    record as large as the largest of them allows (its own default is 1 MB)."""
    return {"message.max.bytes": str(largest_message(*specs))}


PROMPTS_STATS = control_topic("prompts.stats")
POLICY_VERSIONS = control_topic("policy.versions")
# Who is running: one compacted key per role instance (schemas.control.RoleHeartbeat).
ROLES = control_topic("rollstream.roles")

ALL_TOPICS: tuple[TopicSpec, ...] = (
    ROLLOUTS_RAW,
    ROLLOUTS_SCORED,
    ROLLOUTS_STALE,
    ROLLOUTS_DLQ,
    ROLLOUTS_FILTERED,
    PROMPTS_STATS,
    POLICY_VERSIONS,
    ROLES,
)
