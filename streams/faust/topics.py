"""The stream worker's topics: the ones it reads and writes, created when missing.

The names come from ``[streams.topics]`` (a test or a second policy renames them); the
settings, sizes included, from ``schemas.topics``. The internal ticks topic and the table
changelogs get raw's partition count: Faust gives a worker the same partitions of all of
them, so a tick reaches the worker that holds the overdue group (``streams.faust.app``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from confluent_kafka.admin import AdminClient

from core.config import KafkaConfig
from infra.topics import check_sizes, ensure_topics
from schemas.topics import (
    MIB,
    POLICY_VERSIONS,
    PROMPTS_STATS,
    ROLLOUTS_DLQ,
    ROLLOUTS_FILTERED,
    ROLLOUTS_RAW,
    ROLLOUTS_SCORED,
    ROLLOUTS_STALE,
    TopicSpec,
    stream_changelog,
)
from streams.config import StreamsConfig

TICKS_RETENTION_MS = 60 * 60 * 1000
"""A tick only matters until the timer sends the next one."""

TABLE_NAME = "groups"
"""The group table: its changelog topic is ``<app_id>-groups-changelog``. Renaming it would
leave every running app's state behind in the old changelog."""


MEMORY_TABLE_NAME = "groups-memory"
"""The Faust table that holds the worker's memory of the group table. Its own changelog
(``<app_id>-groups-memory-changelog``) is never written, so Faust's recovery, which
cannot be taken as the state (``streams.faust.restore``), has nothing to replay and ends at
once; each partition is rebuilt from ``changelog_name`` instead."""


def changelog_name(config: StreamsConfig) -> str:
    """The group table's changelog topic (``streams.faust.txn`` writes it)."""
    return f"{config.app_id}-{TABLE_NAME}-changelog"


def memory_changelog_name(config: StreamsConfig) -> str:
    """The changelog Faust declares for ``MEMORY_TABLE_NAME``: empty, co-partitioned with
    raw so that Faust's assignor gives a worker the same partitions of all of them."""
    return f"{config.app_id}-{MEMORY_TABLE_NAME}-changelog"


def leader_topic_spec(config: StreamsConfig) -> TopicSpec:
    """Faust's assignor topic (``<app_id>-__assignor-__leader``), created here so that it
    gets the replication and ``min.insync.replicas`` of every other topic: Faust would
    create it with the factor alone."""
    return TopicSpec(f"{config.app_id}-__assignor-__leader", 1, max_message_bytes=1 * MIB)


def topic_specs(config: StreamsConfig, raw_partitions: int) -> list[TopicSpec]:
    """Every topic the worker uses, under ``config``'s names; the source topics (raw and
    ticks) and the table changelogs with ``raw_partitions``.

    The group table's changelog is declared here with its size: Faust would create it
    with the cluster's default limit (1 MB on most), and a larger sample's changelog write
    would then fail after the step had committed."""
    names = config.topics
    return [
        replace(ROLLOUTS_RAW, name=names.raw, partitions=raw_partitions),
        replace(ROLLOUTS_SCORED, name=names.scored),
        replace(ROLLOUTS_STALE, name=names.stale),
        replace(ROLLOUTS_DLQ, name=names.dlq),
        replace(ROLLOUTS_FILTERED, name=names.filtered),
        replace(PROMPTS_STATS, name=names.prompt_stats),
        replace(POLICY_VERSIONS, name=names.versions),
        TopicSpec(
            config.ticks_topic,
            raw_partitions,
            retention_ms=TICKS_RETENTION_MS,
            max_message_bytes=1 * MIB,
        ),
        stream_changelog(changelog_name(config), raw_partitions),
        stream_changelog(memory_changelog_name(config), raw_partitions),
    ]


def prepare_topics(
    kafka: Mapping[str, str], config: StreamsConfig, settings: KafkaConfig | None = None
) -> list[TopicSpec]:
    """Create missing topics (and Faust's assignor topic) with the replication
    ``settings`` resolve to; returns the worker's specs (raw's partition count is that
    of ``specs[0]``).

    Raw keeps the partition count it already has, whoever created it; a topic that
    exists is never altered, but one whose ``max.message.bytes`` is below its spec's is
    refused here, at start, naming it (``infra.topics.TopicSizeError``)."""
    present = AdminClient(dict(kafka)).list_topics(timeout=30).topics
    if config.topics.raw in present:
        partitions = len(present[config.topics.raw].partitions)
    else:
        partitions = ROLLOUTS_RAW.partitions
    specs = topic_specs(config, partitions)
    ensure_topics(
        kafka,
        [spec for spec in [*specs, leader_topic_spec(config)] if spec.name not in present],
        settings,
    )
    check_sizes(kafka, [spec for spec in specs if spec.name in present])
    return specs
