"""Topic declaration against the real broker: idempotent creation, clear conflicts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from core.config import KafkaConfig
from infra.topics import TopicConflictError, ensure_topics
from schemas.topics import ALL_TOPICS, MIB, POLICY_VERSIONS, ROLLOUTS_RAW, TopicSpec


def _specs(unique_name: Callable[[str], str]) -> list[TopicSpec]:
    return [
        TopicSpec(unique_name("raw"), partitions=3),
        TopicSpec(unique_name("versions"), partitions=1, cleanup_policy="compact"),
    ]


def test_declared_topics_cover_the_data_flow() -> None:
    names = {spec.name for spec in ALL_TOPICS}
    assert names == {
        "rollouts.raw",
        "rollouts.scored",
        "rollouts.stale",
        "rollouts.dlq",
        "rollouts.filtered",
        "prompts.stats",
        "policy.versions",
        "rollstream.roles",
    }
    assert POLICY_VERSIONS.configs()["cleanup.policy"] == "compact"
    assert "retention.ms" not in POLICY_VERSIONS.configs()  # compaction keeps the latest
    assert ROLLOUTS_RAW.partitions > 1  # groups spread over stream workers


def test_creation_is_idempotent(kafka_config: KafkaConfig, unique_name) -> None:
    specs = _specs(unique_name)
    first = ensure_topics(kafka_config.client_config(), specs)
    assert sorted(first.created) == sorted(s.name for s in specs)
    assert first.existing == ()

    second = ensure_topics(kafka_config.client_config(), specs)
    assert second.created == ()
    assert sorted(second.existing) == sorted(s.name for s in specs)

    admin = AdminClient(kafka_config.client_config())
    topics = admin.list_topics(timeout=10).topics
    assert len(topics[specs[0].name].partitions) == 3
    resource = ConfigResource(ResourceType.TOPIC, specs[1].name)
    configs = admin.describe_configs([resource])[resource].result()
    assert configs["cleanup.policy"].value == "compact"


def test_conflicting_topic_is_reported_with_every_difference(
    kafka_config: KafkaConfig, unique_name
) -> None:
    name = unique_name("conflict")
    ensure_topics(kafka_config.client_config(), [TopicSpec(name, partitions=2)])
    # max.message.bytes is a floor: only a smaller existing value disagrees
    wanted = TopicSpec(name, partitions=4, cleanup_policy="compact", max_message_bytes=16 * MIB)
    with pytest.raises(TopicConflictError) as excinfo:
        ensure_topics(kafka_config.client_config(), [wanted])
    message = str(excinfo.value)
    assert f"{name}: 2 partitions, declared 4" in message
    assert f"{name}: cleanup.policy=delete, declared compact" in message
    assert f"{name}: max.message.bytes={8 * MIB}, declared {16 * MIB}" in message
    assert len(excinfo.value.conflicts) == 3
