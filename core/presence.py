"""Who is in a run: role instances beat on a compacted topic, anyone can read who is there.

Roles join and leave a run from any machine (``rollstream produce`` / ``stream`` /
``train`` with the run's config), so no single process knows how many there are. Each
running instance sends a ``schemas.control.RoleHeartbeat`` every ``interval_s`` on the
run's presence topic (``rollstream.roles``, compacted, one key per instance), and one
``left`` heartbeat when it stops cleanly. A reader (``read_presence``) takes the newest
heartbeat of every instance of a run and sorts them into ``active``, ``left`` (stopped
cleanly: its ``detail`` says what it did with its work in flight) and ``silent`` (no beat
for three intervals: killed, or cut off from the broker).

Heartbeats are best effort: a broker outage delays them and nothing else waits on them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from schemas.control import RoleHeartbeat
from schemas.topics import ROLES, producer_limits

logger = logging.getLogger(__name__)

SILENT_AFTER_INTERVALS = 3.0

T = TypeVar("T")


def default_instance() -> str:
    """``<host>-<pid>``: unique among the processes of a run at any one time."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Beacon:
    """Sends one role instance's heartbeats from a daemon thread until ``leave``.

    ``detail`` is called for every heartbeat; what it returns (small, JSON-able) rides
    along, so a reader sees figures such as groups delivered without scraping metrics.
    """

    def __init__(
        self,
        client_config: Mapping[str, str],
        topic: str,
        *,
        run: str,
        role: str,
        instance: str | None = None,
        interval_s: float = 5.0,
        detail: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.run = run
        self.role = role
        self.instance = instance or default_instance()
        self.interval_s = interval_s
        self._detail = detail or dict
        self._producer = Producer(
            {
                **client_config,
                **producer_limits(ROLES),
                "linger.ms": 0,
                "acks": "all",
                "message.timeout.ms": 30_000,
            }
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._disabled = False

    def heartbeat(self, state: str, detail: dict[str, Any] | None = None) -> RoleHeartbeat:
        """The heartbeat this instance would send now."""
        return RoleHeartbeat(
            run=self.run,
            role=self.role,
            instance=self.instance,
            host=socket.gethostname(),
            pid=os.getpid(),
            state=state,
            at_ms=int(time.time() * 1000),
            interval_s=self.interval_s,
            detail=self._detail() if detail is None else detail,
        )

    def _send(self, beat: RoleHeartbeat) -> None:
        try:
            self._producer.produce(self.topic, key=beat.key, value=beat.to_json())
            self._producer.poll(0)
        except Exception as exc:  # a full queue or a missing topic: the next beat retries
            logger.warning("presence: heartbeat not sent (%s)", exc)

    def start(self) -> Beacon:
        """Say ``up`` now, then every ``interval_s`` from a daemon thread. Without the
        topic (``rollstream topics ensure`` declares it) the beacon stays silent."""
        try:
            meta = self._producer.list_topics(self.topic, timeout=10).topics.get(self.topic)
        except Exception as exc:  # the broker is away: beat anyway, the queue rides it out
            logger.warning("presence: could not look up %s (%s)", self.topic, exc)
        else:
            if meta is None or meta.error is not None:
                logger.warning("presence: no topic %s, so no heartbeats", self.topic)
                self._disabled = True
                return self
        self._send(self.heartbeat("up"))
        self._thread = threading.Thread(target=self._run, name="presence", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                beat = self.heartbeat("up")
            except Exception as exc:  # a detail callback that failed: beat without it
                logger.warning("presence: detail failed (%s)", exc)
                beat = self.heartbeat("up", {})
            self._send(beat)

    def leave(self, detail: dict[str, Any] | None = None, timeout_s: float = 5.0) -> None:
        """Stop beating and say ``left`` (with ``detail``, else the usual figures)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._disabled:
            return
        self._send(self.heartbeat("left", detail))
        self._producer.flush(timeout_s)


@dataclass
class Presence:
    """The newest heartbeat of every instance of one run, sorted by what it says."""

    active: list[RoleHeartbeat] = field(default_factory=list)
    left: list[RoleHeartbeat] = field(default_factory=list)
    silent: list[RoleHeartbeat] = field(default_factory=list)
    malformed: int = 0  # values on the topic that are not heartbeats (skipped)

    def count(self, role: str) -> int:
        """Active instances of ``role``."""
        return sum(beat.role == role for beat in self.active)

    def gone(self, role: str) -> set[str]:
        """Instances of ``role`` that left or went silent."""
        return {beat.instance for beat in (*self.left, *self.silent) if beat.role == role}


def classify(beats: Mapping[bytes, RoleHeartbeat], now_ms: int) -> Presence:
    """Sort the newest heartbeat per instance into active, left and silent."""
    presence = Presence()
    for beat in sorted(beats.values(), key=lambda b: (b.role, b.instance)):
        if beat.state == "left":
            presence.left.append(beat)
        elif now_ms - beat.at_ms > SILENT_AFTER_INTERVALS * beat.interval_s * 1000:
            presence.silent.append(beat)
        else:
            presence.active.append(beat)
    return presence


def read_presence(
    client_config: Mapping[str, str], topic: str, run: str, *, now_ms: int | None = None
) -> Presence:
    """Every instance of ``run`` on ``topic`` (the whole, compacted topic is small).
    A missing topic reads as nobody; a value that is not a heartbeat is counted and
    skipped. Ages are taken at the start of the read (its own time does not count)."""
    from confluent_kafka import Consumer, KafkaException

    from core.topic_reader import read_range, reader_config, whole_topic

    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    consumer = Consumer(reader_config(client_config, "presence"))
    newest: dict[bytes, RoleHeartbeat] = {}
    malformed = 0
    try:
        try:
            plan = whole_topic(consumer, topic)
        except KafkaException:
            return Presence()
        for msg in read_range(consumer, topic, plan, idle_timeout_s=10.0):
            value = msg.value()
            if value is None:
                continue  # a tombstone
            try:
                beat = RoleHeartbeat.from_json(value)
            except ValueError:
                malformed += 1
                continue
            if beat.run == run:
                newest[beat.key] = beat
    finally:
        consumer.close()
    presence = classify(newest, now_ms)
    presence.malformed = malformed
    return presence


class Poller(Generic[T]):
    """Calls ``fetch`` every ``interval_s`` on a daemon thread, so that a caller who wants
    the answer (a display, the trainer's producer count) never waits on Kafka; ``latest``
    is the newest answer (None before the first, kept while fetching fails)."""

    def __init__(self, fetch: Callable[[], T], interval_s: float = 5.0) -> None:
        self.fetch = fetch
        self.interval_s = interval_s
        self.latest: T | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="presence-poll", daemon=True)

    def start(self) -> Poller[T]:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.latest = self.fetch()
            except Exception:  # the broker is away: keep the last answer
                logger.debug("presence: poll failed", exc_info=True)
            if self._stop.wait(self.interval_s):
                return

    def close(self) -> None:
        self._stop.set()
