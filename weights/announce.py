"""Announcements of new versions on ``policy.versions``: the producer and the listener.

Weights travel through S3; Kafka only carries the small ``VersionAnnouncement`` that says
"version N of run R is published, its manifest hashes to H". The topic is compacted and
keyed by run id, so a listener that starts late still finds each run's latest version.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from schemas.control import VersionAnnouncement

log = logging.getLogger(__name__)

DEFAULT_TOPIC = "policy.versions"


class Announcer:
    """Idempotent producer; ``announce`` returns once the broker has acknowledged."""

    def __init__(
        self, client_config: Mapping[str, str], topic: str = DEFAULT_TOPIC, timeout_s: float = 30
    ) -> None:
        self.topic = topic
        self.timeout_s = timeout_s
        self._producer = Producer(
            {
                **client_config,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                "message.timeout.ms": int(timeout_s * 1000),
            }
        )

    def announce(self, announcement: VersionAnnouncement) -> None:
        """Produce and wait for the delivery report; raises ``KafkaException`` on failure."""
        errors: list[KafkaError] = []

        def delivered(err: KafkaError | None, _msg: object) -> None:
            if err is not None:
                errors.append(err)

        self._producer.produce(
            self.topic,
            key=announcement.run.encode(),
            value=announcement.to_json(),
            on_delivery=delivered,
        )
        if self._producer.flush(self.timeout_s) > 0:
            raise KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT, "announcement not acked"))
        if errors:
            raise KafkaException(errors[0])

    def close(self) -> None:
        self._producer.flush(self.timeout_s)


class AnnouncementListener:
    """Reads every announcement of one run from the start of the (compacted) topic.

    Each listener uses its own consumer group: every follower must see every
    announcement, so there is nothing to share, and no offsets are committed.
    """

    def __init__(
        self, client_config: Mapping[str, str], run: str, topic: str = DEFAULT_TOPIC
    ) -> None:
        self.run = run
        self._consumer = Consumer(
            {
                **client_config,
                "group.id": f"rollstream-weights-{run}-{uuid.uuid4().hex[:12]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "enable.partition.eof": False,
            }
        )
        self._consumer.subscribe([topic])

    def next(self, timeout_s: float) -> VersionAnnouncement | None:
        """The newest announcement for the run among those that arrive within
        ``timeout_s`` (older ones in the same batch are skipped), or None."""
        newest: VersionAnnouncement | None = None
        # ``poll`` returns at the first message; ``consume`` would wait for a full batch.
        first = self._consumer.poll(timeout_s)
        messages = [] if first is None else [first]
        while messages:
            for msg in messages:
                if msg.error():
                    log.warning("policy.versions consumer error: %s", msg.error())
                    continue
                if msg.key() != self.run.encode():
                    continue
                try:
                    found = VersionAnnouncement.from_json(msg.value())
                except ValueError as err:
                    log.warning("ignoring a malformed announcement: %s", err)
                    continue
                if newest is None or found.version > newest.version:
                    newest = found
            # Drain what is already buffered without waiting again.
            messages = self._consumer.consume(num_messages=1000, timeout=0)
        return newest

    def close(self) -> None:
        self._consumer.close()
