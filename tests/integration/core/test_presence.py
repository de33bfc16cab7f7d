"""Role presence on the real broker: heartbeats in, who is active / left / silent out;
garbage on the topic is skipped and counted; a consumer group's lag per member."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from support.streams import wait_until

from core.config import KafkaConfig
from core.presence import Beacon, classify, read_presence
from core.topic_reader import group_lag
from infra.topics import ensure_topics
from rollstream.debug.roles import stream_worker_lag
from schemas.control import RoleHeartbeat
from schemas.topics import ROLES, TopicSpec

GOOD = {
    "run": "r",
    "role": "producer",
    "instance": "host-1",
    "host": "host",
    "pid": 12,
    "state": "up",
    "at_ms": 1_000,
    "interval_s": 5.0,
    "detail": {"groups": 3},
}


def _roles_topic(kafka: KafkaConfig, unique_name: Callable[[str], str]) -> str:
    name = unique_name("rollstream.roles")
    ensure_topics(kafka.client_config(), [dataclasses.replace(ROLES, name=name)])
    return name


@pytest.mark.unit
@pytest.mark.parametrize(
    "change",
    [
        {"role": "engine"},
        {"role": ""},
        {"state": "gone"},
        {"pid": -1},
        {"pid": "12"},
        {"at_ms": 1.5},
        {"interval_s": 0},
        {"interval_s": True},
        {"instance": ""},
        {"run": 7},
        {"detail": [1, 2]},
    ],
)
def test_garbage_heartbeats_are_refused(change: dict) -> None:
    with pytest.raises(ValueError):
        RoleHeartbeat(**{**GOOD, **change})


@pytest.mark.unit
def test_heartbeat_json_round_trip_and_bad_json() -> None:
    beat = RoleHeartbeat(**GOOD)
    assert RoleHeartbeat.from_json(beat.to_json()) == beat
    assert beat.key == b"r/producer/host-1"
    for bad in (b"", b"[]", b'{"run": "r"}', b"\xff\xfe", RoleHeartbeat(**GOOD).to_json()[:-3]):
        with pytest.raises(ValueError):
            RoleHeartbeat.from_json(bad)


@pytest.mark.unit
def test_silent_after_three_intervals_left_wins_over_age() -> None:
    beats = {
        b"a": RoleHeartbeat(**{**GOOD, "instance": "a", "at_ms": 100_000}),
        b"b": RoleHeartbeat(**{**GOOD, "instance": "b", "at_ms": 100_000 - 16_000}),
        b"c": RoleHeartbeat(**{**GOOD, "instance": "c", "state": "left", "at_ms": 0}),
    }
    presence = classify(beats, now_ms=100_000)
    assert [b.instance for b in presence.active] == ["a"]
    assert [b.instance for b in presence.silent] == ["b"]  # 16 s > 3 x 5 s
    assert [b.instance for b in presence.left] == ["c"]
    assert presence.count("producer") == 1 and presence.count("streams") == 0


def test_beacons_join_leave_and_garbage_is_skipped(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    kafka = kafka_config.client_config()
    topic = _roles_topic(kafka_config, unique_name)
    figures = {"groups": 0}
    first = Beacon(
        kafka, topic, run="run-a", role="producer", instance="p-0", interval_s=2.0,
        detail=lambda: dict(figures),
    ).start()  # fmt: skip
    second = Beacon(kafka, topic, run="run-a", role="streams", instance="s-0", interval_s=2.0)
    second.start()
    other_run = Beacon(kafka, topic, run="run-b", role="trainer", interval_s=2.0).start()
    garbage = Producer(kafka)
    for value in (b"not json", b'{"run": "run-a"}', b"[1]", b""):
        garbage.produce(topic, key=b"run-a/producer/x", value=value)
    garbage.produce(topic, key=b"run-a/producer/y", value=None)  # a tombstone
    garbage.flush(10)
    figures["groups"] = 7
    # Intervals of 2 s: a beat is "silent" after three missed, which loaded cores never
    # reach by accident. Then read once a beat with the new figures has come.
    wait_until(
        lambda: (
            [b.detail for b in read_presence(kafka, topic, "run-a").active if b.instance == "p-0"]
            == [{"groups": 7}]
        ),
        30,
        "a beat with the new figures",
    )
    seen = read_presence(kafka, topic, "run-a")
    assert sorted((b.role, b.instance) for b in seen.active) == [
        ("producer", "p-0"),
        ("streams", "s-0"),
    ]
    assert seen.malformed == 4
    assert next(b for b in seen.active if b.instance == "p-0").detail == {"groups": 7}

    first.leave({"finished": 2, "aborted": 1})
    seen = read_presence(kafka, topic, "run-a")
    assert [b.instance for b in seen.active] == ["s-0"]
    assert [(b.instance, b.detail) for b in seen.left] == [("p-0", {"finished": 2, "aborted": 1})]

    second._stop.set()  # as if killed: no `left`, the beats just stop
    second._thread.join(5)  # type: ignore[union-attr]
    later = int(time.time() * 1000) + 7_000  # more than three 2 s intervals on
    seen = read_presence(kafka, topic, "run-a", now_ms=later)
    assert [b.instance for b in seen.silent] == ["s-0"] and not seen.active
    assert read_presence(kafka, topic, "run-b").count("trainer") == 1
    other_run.leave()
    assert read_presence(kafka, unique_name("missing"), "run-a").active == []


def test_a_beacon_without_its_topic_stays_silent(
    kafka_config: KafkaConfig, unique_name: Callable[[str], str]
) -> None:
    began = time.monotonic()
    beacon = Beacon(
        kafka_config.client_config(), unique_name("absent"), run="r", role="producer"
    ).start()
    beacon.leave()
    assert time.monotonic() - began < 15  # no wait on undeliverable heartbeats


def test_group_lag_per_member(kafka_config: KafkaConfig, unique_name: Callable[[str], str]) -> None:
    kafka = kafka_config.client_config()
    topic = unique_name("lagged")
    ensure_topics(kafka, [TopicSpec(topic, partitions=2)])
    producer = Producer(kafka)
    for i in range(10):
        producer.produce(topic, value=b"x", partition=i % 2)
    producer.flush(10)
    group = unique_name("group")
    consumer = Consumer(
        {**kafka, "group.id": group, "client.id": "app-worker-7", "enable.auto.commit": False,
         "auto.offset.reset": "earliest"}
    )  # fmt: skip
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.2)
        consumer.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)
        members = group_lag(kafka, group, topic)
    finally:
        consumer.close()
    assert [(m.client_id, m.partitions, m.lag) for m in members] == [
        ("app-worker-7", (0, 1), 3 + 5)  # partition 0: 5 - 2; partition 1 never committed
    ]
    assert [(w.instance, w.lag) for w in stream_worker_lag(members, "app-worker")] == [("7", 8)]
    assert group_lag(kafka, unique_name("nobody"), topic) == []


@pytest.mark.unit
def test_producers_that_left_stop_counting_at_once() -> None:
    from consumers.trainer import sharing_producers

    beats = {
        b"a": RoleHeartbeat(**{**GOOD, "instance": "a", "at_ms": 100_000}),
        b"b": RoleHeartbeat(**{**GOOD, "instance": "b", "state": "left", "at_ms": 99_000}),
        b"c": RoleHeartbeat(**{**GOOD, "instance": "c", "at_ms": 1_000}),  # silent
        b"s": RoleHeartbeat(**{**GOOD, "instance": "s", "role": "streams", "state": "left"}),
    }
    gone = classify(beats, now_ms=100_000).gone("producer")
    assert gone == {"b", "c"}
    recent = [{"a", "b"}, {"a", "b", "c"}, {"a"}]
    assert sharing_producers(recent, set()) == 3
    assert sharing_producers(recent, gone) == 1  # b's last groups are still trained
    assert sharing_producers([{"b"}], gone) is None
    assert sharing_producers([], set()) is None


@pytest.mark.unit
def test_the_trainer_exports_role_counts_and_a_worker_finds_its_lag() -> None:
    from consumers.metrics import MetricsSink
    from core.topic_reader import MemberLag, member_of

    beats = {
        b"a": RoleHeartbeat(**{**GOOD, "instance": "a", "at_ms": 100_000}),
        b"b": RoleHeartbeat(**{**GOOD, "instance": "b", "state": "left", "at_ms": 99_000}),
        b"s": RoleHeartbeat(**{**GOOD, "instance": "s", "role": "streams", "at_ms": 1_000}),
    }
    sink = MetricsSink(None)
    sink.record_roles(classify(beats, now_ms=100_000))
    value = sink.registry.get_sample_value
    assert value("rollstream_trainer_run_roles", {"role": "producer", "state": "active"}) == 1
    assert value("rollstream_trainer_run_roles", {"role": "producer", "state": "left"}) == 1
    assert value("rollstream_trainer_run_roles", {"role": "streams", "state": "silent"}) == 1
    assert value("rollstream_trainer_run_roles", {"role": "trainer", "state": "active"}) == 0

    members = [MemberLag("app-x", "h", (0, 1), 5), MemberLag("app-y", "h", (2,), 0)]
    assert member_of(members, "app-y") == members[1]
    assert member_of(members, "app-z") is None
