"""Create rollstream's topics idempotently and report existing ones that disagree.

A topic that already exists is left alone when its partition count and the configs in
its ``TopicSpec`` match; otherwise ``TopicConflictError`` lists every difference, since
silently using e.g. a non-compacted ``policy.versions`` would lose the current version.
``max.message.bytes`` is a floor: a topic may take larger records than declared, never
smaller ones (``check_sizes`` checks only that). A topic the cluster refuses to create
as declared (a managed cluster's cap on ``max.message.bytes``, say) is a
``TopicRefusedError`` naming it and the configs asked for.

Every topic is created with the replication ``KafkaConfig.replication`` resolves for the
cluster's broker count (``replication``); Faust's own topics get the same factor
(``streams.faust.worker``), so there is one setting and one resolver for all of them. An
existing topic's replication is left as it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from core.config import KafkaConfig, Replication
from core.retry import permanent
from schemas.topics import ALL_TOPICS, TopicSpec

#: Configs where the topic's value may exceed the declared one.
AT_LEAST = frozenset({"max.message.bytes"})
#: How often to ask again for a topic the broker does not list yet (``_listed``).
LISTED_POLL_S = 0.2


class TopicConflictError(RuntimeError):
    """Existing topics whose settings differ from their declaration."""

    def __init__(self, conflicts: list[str]) -> None:
        self.conflicts = conflicts
        super().__init__(
            "existing topics disagree with schemas/topics.py:\n  " + "\n  ".join(conflicts)
        )


class TopicRefusedError(RuntimeError):
    """The cluster will not create a topic with the settings rollstream needs."""

    def __init__(self, spec: TopicSpec, err: KafkaException) -> None:
        self.spec = spec
        super().__init__(
            f"the Kafka cluster refused to create topic {spec.name!r} with "
            f"{spec.partitions} partitions and {spec.configs()}: {err.args[0]}. "
            "rollstream needs these settings (schemas/topics.py); create the topic with "
            "them by hand, or raise the cluster's limits"
        )


@dataclass(frozen=True)
class TopicReport:
    created: tuple[str, ...]
    existing: tuple[str, ...]


def replication(
    client_config: Mapping[str, str], kafka: KafkaConfig | None = None, timeout: float = 30.0
) -> Replication:
    """The replication of topics created on this cluster: ``kafka``'s settings (none:
    the defaults) resolved against its broker count, read from its metadata."""
    brokers = len(AdminClient(dict(client_config)).list_topics(timeout=timeout).brokers)
    return (kafka or KafkaConfig()).replication(brokers)


def ensure_topics(
    client_config: Mapping[str, str],
    specs: Iterable[TopicSpec] = ALL_TOPICS,
    kafka: KafkaConfig | None = None,
    timeout: float = 30.0,
) -> TopicReport:
    """Create missing topics with the replication ``kafka`` resolves to (none: the
    defaults), verify existing ones; raises ``TopicConflictError``. Returns once the
    broker lists every topic of ``specs`` (``_listed``)."""
    specs = list(specs)
    admin = AdminClient(dict(client_config))
    metadata = admin.list_topics(timeout=timeout)
    present = metadata.topics
    missing = [spec for spec in specs if spec.name not in present]
    created: list[str] = []
    if missing:
        replicas = (kafka or KafkaConfig()).replication(len(metadata.brokers))
        futures = admin.create_topics(
            [
                NewTopic(
                    spec.name,
                    num_partitions=spec.partitions,
                    replication_factor=replicas.factor,
                    config={**spec.configs(), **replicas.topic_configs()},
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
                if err.args[0].name() == "TOPIC_ALREADY_EXISTS":  # lost a race: verify below
                    continue
                if permanent(err):
                    spec = next(spec for spec in missing if spec.name == name)
                    raise TopicRefusedError(spec, err) from err
                raise
    listed = _listed(admin, [spec.name for spec in specs], timeout) if missing else present
    existing = [spec for spec in specs if spec.name not in created]
    conflicts = _conflicts(admin, listed, existing, timeout) if existing else []
    if conflicts:
        raise TopicConflictError(conflicts)
    return TopicReport(tuple(created), tuple(spec.name for spec in existing))


def check_sizes(
    client_config: Mapping[str, str], specs: Iterable[TopicSpec], timeout: float = 30.0
) -> None:
    """Raise ``TopicConflictError`` naming every topic of ``specs`` whose
    ``max.message.bytes`` is below its spec's (its records would be refused)."""
    specs = list(specs)
    if not specs:
        return
    admin = AdminClient(dict(client_config))
    described = _describe(admin, specs, timeout)
    conflicts = []
    for spec in specs:
        have = described[spec.name].get("max.message.bytes")
        if have is None or int(have.value) < spec.max_message_bytes:
            conflicts.append(
                f"{spec.name}: max.message.bytes={None if have is None else have.value}, "
                f"needs at least {spec.max_message_bytes}"
            )
    if conflicts:
        raise TopicConflictError(conflicts)


def _describe(admin: AdminClient, specs: list[TopicSpec], timeout: float) -> dict:
    """Each topic's configs, one request a topic: librdkafka failed to parse a stock
    Kafka 4.1 broker's answer to one request for many topics (``_BAD_MSG``)."""
    described = {}
    for spec in specs:
        resource = ConfigResource(ResourceType.TOPIC, spec.name)
        [future] = admin.describe_configs([resource], request_timeout=timeout).values()
        described[spec.name] = future.result()
    return described


def _listed(admin: AdminClient, names: list[str], timeout: float) -> dict:
    """The cluster's topics, once the broker lists every one of ``names`` (or after
    ``timeout``), so that a topic is usable when ``ensure_topics`` returns. A topic just
    created reaches the broker's metadata a moment after the controller answered: under
    load (three test processes on one broker) it was not listed yet, and creating it again
    said TOPIC_ALREADY_EXISTS while describing it said UNKNOWN_TOPIC_OR_PART."""
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        listed = all(name in topics and topics[name].error is None for name in names)
        if listed or time.monotonic() > deadline:
            return topics
        time.sleep(LISTED_POLL_S)


def _conflicts(
    admin: AdminClient, topics: dict, specs: list[TopicSpec], timeout: float
) -> list[str]:
    described = _describe(admin, specs, timeout)
    conflicts: list[str] = []
    for spec in specs:
        partitions = len(topics[spec.name].partitions)
        if partitions != spec.partitions:
            conflicts.append(f"{spec.name}: {partitions} partitions, declared {spec.partitions}")
        actual = described[spec.name]
        for key, wanted in spec.configs().items():
            have = actual[key].value if key in actual else None
            if key in AT_LEAST and have is not None and int(have) >= int(wanted):
                continue
            if have != wanted:
                conflicts.append(f"{spec.name}: {key}={have}, declared {wanted}")
    return conflicts
