"""The stream worker's topics: the ones it reads and writes, created when missing.

The names come from ``[streams.topics]`` (a test or a second policy renames them); the
settings from ``schemas.topics``. The internal ticks topic gets raw's partition count:
Faust gives a worker the same partitions of both, so a tick reaches the worker that holds
the overdue group (``streams.app``).
"""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka.admin import AdminClient

from infra.topics import ensure_topics
from schemas.topics import (
    POLICY_VERSIONS,
    PROMPTS_STATS,
    ROLLOUTS_DLQ,
    ROLLOUTS_FILTERED,
    ROLLOUTS_RAW,
    ROLLOUTS_SCORED,
    ROLLOUTS_STALE,
    TopicSpec,
)
from streams.config import StreamsConfig

TICKS_RETENTION_MS = 60 * 60 * 1000
"""A tick only matters until the timer sends the next one."""


def topic_specs(config: StreamsConfig, raw_partitions: int) -> list[TopicSpec]:
    """Every topic the worker uses, under ``config``'s names; the source topics (raw and
    ticks) with ``raw_partitions``."""
    names = config.topics
    return [
        TopicSpec(names.raw, raw_partitions),
        TopicSpec(names.scored, ROLLOUTS_SCORED.partitions, max_message_bytes=16 * 1024 * 1024),
        TopicSpec(
            names.stale,
            ROLLOUTS_STALE.partitions,
            retention_ms=ROLLOUTS_STALE.retention_ms,
        ),
        TopicSpec(
            names.dlq,
            ROLLOUTS_DLQ.partitions,
            retention_ms=ROLLOUTS_DLQ.retention_ms,
            max_message_bytes=ROLLOUTS_DLQ.max_message_bytes,
        ),
        TopicSpec(
            names.filtered,
            ROLLOUTS_FILTERED.partitions,
            retention_ms=ROLLOUTS_FILTERED.retention_ms,
            max_message_bytes=ROLLOUTS_FILTERED.max_message_bytes,
        ),
        TopicSpec(
            names.prompt_stats,
            PROMPTS_STATS.partitions,
            cleanup_policy="compact",
            max_message_bytes=PROMPTS_STATS.max_message_bytes,
            extra_configs=PROMPTS_STATS.extra_configs,
        ),
        TopicSpec(
            names.versions,
            POLICY_VERSIONS.partitions,
            cleanup_policy="compact",
            max_message_bytes=POLICY_VERSIONS.max_message_bytes,
            extra_configs=POLICY_VERSIONS.extra_configs,
        ),
        TopicSpec(config.ticks_topic, raw_partitions, retention_ms=TICKS_RETENTION_MS),
    ]


def prepare_topics(kafka: Mapping[str, str], config: StreamsConfig) -> int:
    """Create missing topics; the ticks topic gets raw's partition count. Returns it.

    Raw keeps the partition count it already has, whoever created it;
    a topic that exists is never altered."""
    present = AdminClient(dict(kafka)).list_topics(timeout=30).topics
    if config.topics.raw in present:
        partitions = len(present[config.topics.raw].partitions)
    else:
        partitions = ROLLOUTS_RAW.partitions
    missing = [spec for spec in topic_specs(config, partitions) if spec.name not in present]
    ensure_topics(kafka, missing, replication_factor=config.replication_factor)
    return partitions
