"""Topic sizes on a cluster left at Kafka's stock limits (1 MB a message, as on managed
clusters): every topic the stream worker uses, the group table's changelog included, is
created with the size its records need, and one that exists smaller is refused at start
with its name. The session broker allows 16 MiB everywhere, which would hide all this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource

from core.config import KafkaConfig, PresenceConfig, SharedConfig
from infra.kafka import EmbeddedKafka
from infra.topics import TopicConflictError, ensure_topics
from schemas.topics import MIB, TopicSpec
from streams.config import OldLogitsConfig, StreamsConfig, StreamTopics
from streams.faust.app import build_app
from streams.faust.topics import topic_specs

pytestmark = pytest.mark.integration


class StockKafka(EmbeddedKafka):
    """The embedded broker without rollstream's raised limits: Kafka's defaults apply."""

    def properties(self) -> dict[str, str]:
        props = super().properties()
        for key in ("message.max.bytes", "replica.fetch.max.bytes"):
            props.pop(key)
        return props


@pytest.fixture(scope="module")
def stock_kafka(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[dict]:
    broker = StockKafka(KafkaConfig(), tmp_path_factory.mktemp("kafka-stock"), cache_dir)
    try:
        yield KafkaConfig(bootstrap_servers=broker.start()).client_config()
    finally:
        broker.stop()


def streams_config(unique_name: Callable[[str], str]) -> StreamsConfig:
    topics = StreamTopics(
        raw=unique_name("raw"),
        scored=unique_name("scored"),
        stale=unique_name("stale"),
        dlq=unique_name("dlq"),
        filtered=unique_name("filtered"),
        prompt_stats=unique_name("prompt-stats"),
        versions=unique_name("versions"),
    )
    return StreamsConfig(
        app_id=unique_name("app"), topics=topics, old_logits=OldLogitsConfig(mode="off")
    )


def shared(kafka: dict) -> SharedConfig:
    return SharedConfig(
        run_id="run-stock",
        kafka=KafkaConfig(bootstrap_servers=kafka["bootstrap.servers"]),
        presence=PresenceConfig(),
        weights={"allow_unsigned": True},  # topic sizes only: no versions are read here
    )


def changelog_name(config: StreamsConfig) -> str:
    return f"{config.app_id}-groups-changelog"


def max_bytes(kafka: dict, names: list[str], timeout_s: float = 30) -> dict[str, int]:
    """``max.message.bytes`` of each topic (asked again while a topic just created is not
    known to the broker's metadata yet)."""
    admin = AdminClient(kafka)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return {
                name: int(f.result()["max.message.bytes"].value)
                for name in names
                for f in admin.describe_configs([ConfigResource("topic", name)]).values()
            }
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_stream_worker_sizes_every_topic_it_uses_changelog_included(
    stock_kafka: dict, unique_name: Callable[[str], str], tmp_path: Path
) -> None:
    config = streams_config(unique_name)
    build_app(shared(stock_kafka), config, tmp_path)  # declares every topic the worker uses

    specs = {spec.name: spec for spec in topic_specs(config, raw_partitions=8)}
    changelog = changelog_name(config)
    assert changelog in specs  # the steps write it; Faust's own table's stays empty
    sizes = max_bytes(stock_kafka, [*specs, changelog])
    assert {name: sizes[name] >= spec.max_message_bytes for name, spec in specs.items()} == {
        name: True for name in specs
    }
    # a sample at the stream's record limit (4 MiB) fits its changelog write
    assert sizes[changelog] > 4 * MIB
    producer = Producer({**stock_kafka, "message.max.bytes": sizes[changelog]})
    errors: list[object] = []
    producer.produce(
        changelog, key=b"k", value=b"x" * (4 * MIB), on_delivery=lambda e, _m: errors.append(e)
    )
    assert producer.flush(30) == 0 and errors == [None]


def test_an_existing_changelog_too_small_is_refused_at_start_by_name(
    stock_kafka: dict, unique_name: Callable[[str], str], tmp_path: Path
) -> None:
    config = streams_config(unique_name)
    changelog = changelog_name(config)
    # as Faust used to create it: compacted, with the cluster's default size
    spec = TopicSpec(changelog, 8, cleanup_policy="compact", max_message_bytes=1_048_588)
    ensure_topics(stock_kafka, [spec])
    assert max_bytes(stock_kafka, [changelog]) == {changelog: 1_048_588}
    with pytest.raises(TopicConflictError, match=rf"{changelog}: max.message.bytes=1048588"):
        build_app(shared(stock_kafka), config, tmp_path)
