"""Topic declaration against the real broker: idempotent creation, clear conflicts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, ConfigSource, ResourceType

from core.config import ConfigurationError, KafkaConfig, Replication
from infra.topics import TopicConflictError, ensure_topics, replication
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


# --- replication: one setting, one resolver -------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "brokers", "resolved"),
    [
        ({}, 1, Replication(1, None)),  # the embedded broker
        ({}, 2, Replication(2, None)),
        ({}, 3, Replication(3, 2)),
        ({}, 9, Replication(3, 2)),
        ({"replication_factor": 2}, 9, Replication(2, None)),
        ({"replication_factor": 5}, 9, Replication(5, 4)),
        ({"min_insync_replicas": 1}, 9, Replication(3, 1)),
        ({"replication_factor": 2, "min_insync_replicas": 2}, 2, Replication(2, 2)),
    ],
)
def test_the_resolver_follows_the_cluster_s_broker_count(
    settings: dict, brokers: int, resolved: Replication
) -> None:
    assert KafkaConfig(**settings).replication(brokers) == resolved


def test_the_resolver_refuses_what_the_cluster_cannot_hold() -> None:
    with pytest.raises(ConfigurationError, match="replication_factor = 3 but the cluster has 2"):
        KafkaConfig(replication_factor=3).replication(2)
    with pytest.raises(ConfigurationError, match="min_insync_replicas = 3 is more than"):
        KafkaConfig(min_insync_replicas=3).replication(2)
    with pytest.raises(ConfigurationError, match="no brokers"):
        KafkaConfig().replication(0)


def test_topics_get_the_resolved_replication(kafka_config: KafkaConfig, unique_name) -> None:
    """On the embedded broker (one broker): one replica each, ``min.insync.replicas`` as
    configured (else the broker's default), and a factor it cannot hold refused."""
    client = kafka_config.client_config()
    assert replication(client) == Replication(1, None)
    plain, pinned = unique_name("rf-default"), unique_name("rf-pinned")
    ensure_topics(client, [TopicSpec(plain, 2)])
    settings = kafka_config.model_copy(update={"replication_factor": 1, "min_insync_replicas": 1})
    ensure_topics(client, [TopicSpec(pinned, 2)], settings)
    admin = AdminClient(client)
    topics = admin.list_topics(timeout=10).topics
    for name in (plain, pinned):
        assert [len(p.replicas) for p in topics[name].partitions.values()] == [1, 1]
    described = {}
    for name in (plain, pinned):
        resource = ConfigResource(ResourceType.TOPIC, name)
        described[name] = admin.describe_configs([resource])[resource].result()
    assert described[pinned]["min.insync.replicas"].value == "1"
    assert (
        described[pinned]["min.insync.replicas"].source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    )
    assert described[plain]["min.insync.replicas"].source != ConfigSource.DYNAMIC_TOPIC_CONFIG.value

    too_many = kafka_config.model_copy(update={"replication_factor": 3})
    with pytest.raises(ConfigurationError, match="the cluster has 1 broker"):
        ensure_topics(client, [TopicSpec(unique_name("rf-3"), 1)], too_many)
