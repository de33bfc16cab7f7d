"""The stream's version reader on the real broker: it never fails open.

A read that fails (topic unavailable, a callback that raises) is counted, retried with
back-off and never reported as caught up; a malformed announcement is counted and
skipped; the thread only ends when it is stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer
from support.streams import wait_until

from core.config import KafkaConfig, RetryConfig
from infra.kafka import EmbeddedKafka
from infra.topics import ensure_topics
from schemas.control import VersionAnnouncement
from schemas.topics import TopicSpec
from streams.staleness import VersionTracker
from streams.versions import VersionReader
from weights.announce import AnnouncementListener, Announcer

RUN = "run-versions"
QUICK = RetryConfig(initial_s=0.05, max_s=0.5)


def announcement(version: int, run: str = RUN) -> VersionAnnouncement:
    return VersionAnnouncement(run, version, f"s3://b/v{version}/", None, version, "0" * 64, 1, 1)


def announce(kafka: KafkaConfig, topic: str, *versions: int) -> None:
    announcer = Announcer(kafka.client_config(), topic)
    for version in versions:
        announcer.announce(announcement(version))
    announcer.close()


def create(kafka: KafkaConfig, topic: str) -> None:
    ensure_topics(kafka.client_config(), [TopicSpec(topic, 1, cleanup_policy="compact")])


def errors(reader: VersionReader, kind: str) -> float:
    value = reader.metrics.registry.get_sample_value(
        "rollstream_streams_version_read_errors_total", {"kind": kind}
    )
    return value or 0.0


def reopened(caplog: pytest.LogCaptureFixture, why: str) -> int:
    """How many times the listener replaced its consumer because ``why``."""
    return sum(f"{why}; reading on with a fresh consumer" in r.getMessage() for r in caplog.records)


def test_an_unavailable_topic_is_retried_counted_and_never_caught_up(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("versions")  # not created yet: every read fails
    tracker = VersionTracker()
    reader = VersionReader(kafka_config.client_config(), topic, RUN, tracker, retry=QUICK)
    reader.start()
    try:
        wait_until(lambda: errors(reader, "unavailable") >= 3, 60, "three failed reads")
        assert not reader.caught_up.is_set()
        assert (
            reader.metrics.registry.get_sample_value("rollstream_streams_version_reader_failing")
            == 1
        )
        assert reader.alive()

        create(kafka_config, topic)  # the topic recovers
        announce(kafka_config, topic, 3, 7)
        assert tracker.wait_for(7, 60)
        wait_until(reader.caught_up.is_set, 60, "caught up after the recovery")
        assert (
            reader.metrics.registry.get_sample_value("rollstream_streams_version_reader_failing")
            == 0
        )
    finally:
        reader.stop()
    assert not reader.alive()


def test_a_failing_callback_is_retried_and_does_not_end_the_reader(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("versions")
    create(kafka_config, topic)
    announce(kafka_config, topic, 4)
    calls: list[int] = []
    failures = 3

    def on_version(version: int) -> None:
        nonlocal failures
        calls.append(version)
        if failures:
            failures -= 1
            raise RuntimeError("snapshot store full")

    tracker = VersionTracker()
    reader = VersionReader(
        kafka_config.client_config(), topic, RUN, tracker, on_version, retry=QUICK
    )
    reader.start()
    try:
        # v4 is handed over again until the callback takes it
        wait_until(lambda: len(calls) >= 4, 60, "the callback retried")
        assert calls[:4] == [4, 4, 4, 4]
        assert errors(reader, "callback") == 3
        wait_until(reader.caught_up.is_set, 60, "caught up once the callback works")
        announce(kafka_config, topic, 5)  # the thread is still reading
        assert tracker.wait_for(5, 60)
        wait_until(lambda: calls[-1] == 5, 60, "v5 delivered")
        assert reader.alive()
    finally:
        reader.stop()


def test_a_malformed_announcement_is_counted_and_skipped(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("versions")
    create(kafka_config, topic)
    producer = Producer(kafka_config.client_config())
    for value in (
        b"\xff not json",
        b"[1, 2]",
        b'{"run": "run-versions", "version": "seven"}',
        announcement(9, run="someone-else").to_json(),  # body contradicts the key
    ):
        producer.produce(topic, key=RUN.encode(), value=value)
    producer.flush(30)
    announce(kafka_config, topic, 2)

    tracker = VersionTracker()
    reader = VersionReader(kafka_config.client_config(), topic, RUN, tracker, retry=QUICK)
    reader.start()
    try:
        assert tracker.wait_for(2, 60)
        wait_until(reader.caught_up.is_set, 60, "caught up")
        assert errors(reader, "malformed") == 4
        assert tracker.version == 2
        assert reader.alive()
    finally:
        reader.stop()


@pytest.mark.system
def test_a_broker_outage_clears_caught_up_and_the_reader_recovers(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broker of its own, stopped while the reader follows it and started again; the
    reader's consumer is replaced while no broker answers (every second here) and once
    more when one does."""
    monkeypatch.setattr(AnnouncementListener, "REOPEN_AFTER_S", 1.0)
    caplog.set_level(logging.INFO, logger="weights.announce")
    broker = EmbeddedKafka(KafkaConfig(heap="256m"), tmp_path / "kafka", cache_dir)
    kafka = KafkaConfig(bootstrap_servers=broker.start())
    reader: VersionReader | None = None
    try:
        create(kafka, "policy.versions")
        announce(kafka, "policy.versions", 1)
        tracker = VersionTracker()
        reader = VersionReader(
            kafka.client_config(), "policy.versions", RUN, tracker, retry=QUICK
        ).start()
        wait_until(reader.caught_up.is_set, 60, "caught up")
        assert tracker.version == 1

        broker.stop()
        wait_until(lambda: errors(reader, "broker") >= 3, 120, "failed reads")
        wait_until(lambda: not reader.caught_up.is_set(), 60, "caught_up cleared")
        wait_until(lambda: reopened(caplog, "no broker answers it") >= 2, 60, "reopened")
        assert reader.alive()

        broker.start()
        announce(kafka, "policy.versions", 2)
        kinds = ("unavailable", "broker", "consumer", "exception")
        assert tracker.wait_for(2, 120), {k: errors(reader, k) for k in kinds}
        wait_until(reader.caught_up.is_set, 120, "caught up again")
        assert reopened(caplog, "a broker answers again") >= 1
    finally:
        if reader is not None:
            reader.stop()
        broker.stop()
