"""Create rollstream's topics idempotently and report existing ones that disagree.

A topic that already exists is left alone when its partition count and the configs in
its ``TopicSpec`` match; otherwise ``TopicConflictError`` lists every difference, since
silently using e.g. a non-compacted ``policy.versions`` would lose the current version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from schemas.topics import ALL_TOPICS, TopicSpec


class TopicConflictError(RuntimeError):
    """Existing topics whose settings differ from their declaration."""

    def __init__(self, conflicts: list[str]) -> None:
        self.conflicts = conflicts
        super().__init__(
            "existing topics disagree with schemas/topics.py:\n  " + "\n  ".join(conflicts)
        )


@dataclass(frozen=True)
class TopicReport:
    created: tuple[str, ...]
    existing: tuple[str, ...]


def ensure_topics(
    client_config: Mapping[str, str],
    specs: Iterable[TopicSpec] = ALL_TOPICS,
    replication_factor: int = 1,
    timeout: float = 30.0,
) -> TopicReport:
    """Create missing topics, verify existing ones; raises ``TopicConflictError``."""
    specs = list(specs)
    admin = AdminClient(dict(client_config))
    present = admin.list_topics(timeout=timeout).topics
    missing = [spec for spec in specs if spec.name not in present]
    created: list[str] = []
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(
                    spec.name,
                    num_partitions=spec.partitions,
                    replication_factor=replication_factor,
                    config=spec.configs(),
                )
                for spec in missing
            ],
            request_timeout=timeout,
        )
        for name, future in futures.items():
            try:
                future.result()
                created.append(name)
            except KafkaException as err:
                if err.args[0].name() != "TOPIC_ALREADY_EXISTS":  # lost a race: verify below
                    raise
    existing = [spec for spec in specs if spec.name not in created]
    conflicts = _conflicts(admin, existing, timeout) if existing else []
    if conflicts:
        raise TopicConflictError(conflicts)
    return TopicReport(tuple(created), tuple(spec.name for spec in existing))


def _conflicts(admin: AdminClient, specs: list[TopicSpec], timeout: float) -> list[str]:
    topics = admin.list_topics(timeout=timeout).topics
    resources = [ConfigResource(ResourceType.TOPIC, spec.name) for spec in specs]
    described = {
        resource.name: future.result()
        for resource, future in admin.describe_configs(resources, request_timeout=timeout).items()
    }
    conflicts: list[str] = []
    for spec in specs:
        partitions = len(topics[spec.name].partitions)
        if partitions != spec.partitions:
            conflicts.append(f"{spec.name}: {partitions} partitions, declared {spec.partitions}")
        actual = described[spec.name]
        for key, wanted in spec.configs().items():
            have = actual[key].value if key in actual else None
            if have != wanted:
                conflicts.append(f"{spec.name}: {key}={have}, declared {wanted}")
    return conflicts
