"""Announcements of new versions on ``policy.versions``: the producer and the listener.

Weights travel through S3; Kafka only carries the small ``VersionAnnouncement`` that says
"version N of run R is published, its manifest hashes to H". The topic is compacted and
keyed by run id, so a listener that starts late still finds each run's latest version.

Anyone who can produce to the topic can announce anything, so a listener given a
``confirm`` check (``weights.trust.Trust.confirms``) believes an announcement only once
the store holds a genuine manifest with the announced hash: a forged "version 10**12"
is refused (``on_error("forged", ...)``) instead of moving every clock for good. The
manifest does not vouch for the trainer's pace, so a trainer with the run's signing key
signs each announcement, and a listener given ``vouch`` (``Trust.vouched``) clears the
pace of one whose signature does not verify: a replay with a forged pace cannot stop
generation.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from core.topic_reader import reader_config, whole_topic
from schemas.control import VersionAnnouncement, most_producers
from schemas.topics import POLICY_VERSIONS, producer_limits

log = logging.getLogger(__name__)

DEFAULT_TOPIC = "policy.versions"


def _version(item: tuple[tuple[int, str], VersionAnnouncement]) -> int:
    return item[0][0]


class Announcer:
    """Idempotent producer; ``announce`` returns once the broker has acknowledged.

    The trainer's announcer also carries its pace: ``groups_per_step`` and
    ``max_staleness`` are stamped on every announcement it sends (producers derive their
    admission credit from them, ``producers.rollout.worker``). With ``signing_key`` every
    announcement is signed, so that listeners holding the run's public key can tell the
    trainer's pace from a forged one."""

    def __init__(
        self,
        client_config: Mapping[str, str],
        topic: str = DEFAULT_TOPIC,
        timeout_s: float = 30,
        *,
        groups_per_step: int | None = None,
        max_staleness: int | None = None,
        signing_key: Ed25519PrivateKey | None = None,
    ) -> None:
        self.topic = topic
        self.signing_key = signing_key
        self.timeout_s = timeout_s
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.producers: int | None = None  # the trainer updates it as it trains
        self.paused: str | None = None  # a guard's reason to hold generation (consumers.guards)
        self._producer = Producer(
            {
                **client_config,
                **producer_limits(POLICY_VERSIONS),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                "message.timeout.ms": int(timeout_s * 1000),
            }
        )

    def announce(self, announcement: VersionAnnouncement) -> None:
        """Produce and wait for the delivery report; raises ``KafkaException`` on failure."""
        errors: list[KafkaError] = []
        if self.groups_per_step is not None or self.max_staleness is not None:
            announcement = dataclasses.replace(
                announcement,
                groups_per_step=self.groups_per_step,
                max_staleness=self.max_staleness,
                producers=self._producers(),
                paused=self.paused,
            )
        if self.signing_key is not None:
            signature = self.signing_key.sign(announcement.signed_bytes())
            announcement = dataclasses.replace(
                announcement, signature=base64.b64encode(signature).decode()
            )

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

    def _producers(self) -> int | None:
        """``producers`` within what the announcement may say: no more than the groups of
        the last window + 1 steps (each counted producer had one trained in them)."""
        if self.producers is None:
            return None
        return min(self.producers, most_producers(self.groups_per_step, self.max_staleness))

    def close(self) -> None:
        self._producer.flush(self.timeout_s)


class AnnouncementListener:
    """The one reader of ``policy.versions``: every announcement of one run, read from the
    start of the (compacted) topic.

    It joins no consumer group and commits nothing (every follower must see every
    announcement, so there is nothing to share). It remembers the end offsets the topic
    had when it was first read, so ``caught_up`` says when everything announced before
    it started has been seen. A topic that does not exist yet is looked up again on the
    next call.

    ``on_error(kind, detail)`` hears of every read problem, none of which raises here:
    ``unavailable`` (the topic could not be looked up), ``broker`` (no broker can be
    reached: reported on every read until a metadata request answers again),
    ``consumer`` (an error the consumer returned instead of a record) and ``malformed``
    (a record of this run that is not a valid announcement; it is skipped) and ``forged``
    (``confirm`` found no genuine manifest behind it; it is skipped). An announcement
    whose manifest is not in the store yet (a mirror behind) is asked about again on
    each read, until a version at least as new is confirmed: up to ``MAX_PENDING`` such
    announcements are kept, the lowest versions first (the one due next is the lowest; a
    forged far-future one must not crowd it out). ``vouch`` returns what of a confirmed
    announcement to believe (``Trust.vouched``: the pace only if signed).
    """

    MAX_PENDING = 16
    REOPEN_AFTER_S = 10.0  # librdkafka's longest reconnect back-off

    def __init__(
        self,
        client_config: Mapping[str, str],
        run: str,
        topic: str = DEFAULT_TOPIC,
        on_error: Callable[[str, str], None] | None = None,
        confirm: Callable[[VersionAnnouncement], bool | None] | None = None,
        vouch: Callable[[VersionAnnouncement], VersionAnnouncement] | None = None,
    ) -> None:
        self.run = run
        self.topic = topic
        self.on_error = on_error
        self.confirm = confirm  # True: genuine, False: forged, None: not in the store yet
        self.vouch = vouch
        # to confirm again next read, by (version, manifest hash)
        self._pending: dict[tuple[int, str], VersionAnnouncement] = {}
        self._confirmed: int | None = None  # the newest version confirmed so far
        self._config = {
            **reader_config(client_config, f"versions-{run}"),
            "enable.partition.eof": False,
            "error_cb": self._client_error,
        }
        self._consumer = Consumer(self._config)
        self._ends: dict[int, int] | None = None  # partition -> end offset seen at start
        self._caught_up = False
        self._down: str | None = None  # why no broker answers, until one does again
        self._consumer_since = time.monotonic()  # when the consumer in use was made

    def next(self, timeout_s: float) -> VersionAnnouncement | None:
        """The newest announcement for the run among those that arrive within
        ``timeout_s`` (older ones in the same batch are skipped), or None."""
        if self._down is not None and not self._reachable(timeout_s):
            return None
        if self._ends is None and not self._assign():
            time.sleep(timeout_s)
            return None
        read: list[VersionAnnouncement] = []
        # ``poll`` returns at the first message; ``consume`` would wait for a full batch.
        first = self._consumer.poll(timeout_s)
        messages = [] if first is None else [first]
        while messages:
            read.extend(found for msg in messages if (found := self._announcement(msg)))
            # Drain what is already buffered without waiting again.
            messages = self._consumer.consume(num_messages=1000, timeout=0)
        return self._newest_confirmed(read)

    def _newest_confirmed(self, read: list[VersionAnnouncement]) -> VersionAnnouncement | None:
        """The newest of ``read`` (and of those pending) that ``confirm`` accepts."""
        if self.confirm is None:
            return self._vouched(max(read, key=lambda a: a.version, default=None))
        candidates = dict(self._pending)
        for announcement in read:  # the first of a (version, hash) stays: replays add nothing
            if self._confirmed is None or announcement.version > self._confirmed:
                candidates.setdefault((announcement.version, announcement.sha256), announcement)
        self._pending = {}
        newest: VersionAnnouncement | None = None
        for key, announcement in sorted(candidates.items(), key=_version, reverse=True):
            if newest is not None and announcement.version <= newest.version:
                break  # a newer version is confirmed: older ones are moot
            verdict = self.confirm(announcement)
            if verdict:
                newest = announcement
                self._confirmed = announcement.version
            elif verdict is None:
                self._pending[key] = announcement
            else:
                self._error(
                    "forged",
                    f"v{announcement.version}: no genuine manifest with the announced hash",
                )
        if len(self._pending) > self.MAX_PENDING:  # the lowest versions, the first come
            kept = sorted(self._pending.items(), key=_version)[: self.MAX_PENDING]
            self._pending = dict(kept)
        return self._vouched(newest)

    def _vouched(self, announcement: VersionAnnouncement | None) -> VersionAnnouncement | None:
        if announcement is None or self.vouch is None:
            return announcement
        return self.vouch(announcement)

    @property
    def caught_up(self) -> bool:
        """True once every announcement made before the first read has been read."""
        return self._check_caught_up()

    def _check_caught_up(self) -> bool:
        if not self._caught_up and self._ends is not None:
            # position() skips compacted gaps and transaction markers
            tps = [TopicPartition(self.topic, p) for p in self._ends]
            positions = {tp.partition: tp.offset for tp in self._consumer.position(tps)}
            self._caught_up = all(positions[p] >= end for p, end in self._ends.items())
        return self._caught_up

    def latest(self, timeout_s: float = 30.0) -> VersionAnnouncement | None:
        """Read to the end offsets of the first read; the newest announcement, or None.
        Raises ``TimeoutError`` if that end is not reached within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        newest: VersionAnnouncement | None = None
        while True:
            found = self.next(0.2)
            if found is not None and (newest is None or found.version > newest.version):
                newest = found
            if self.caught_up:
                return newest
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.topic} not read to its end in {timeout_s:.0f}s")

    def _assign(self) -> bool:
        """Assign every partition from the beginning; False while the topic is missing or
        its leaders are not known yet (a topic created a moment ago)."""
        try:
            ends = whole_topic(self._consumer, self.topic)
        except KafkaException as err:
            log.info("%s not readable yet (%s); retrying", self.topic, err)
            self._error("unavailable", str(err))
            return False
        self._ends = {p: high for p, (low, high) in ends.items() if high > low}
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in ends])
        return True

    def _client_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (served inside ``poll``): a broker outage is not
        returned as a message, only reported here."""
        if err.code() == KafkaError._ALL_BROKERS_DOWN or err.fatal():
            log.warning("%s: %s", self.topic, err)
            self._down = str(err)
        else:  # a single lost connection: librdkafka reconnects by itself
            log.info("%s: %s", self.topic, err)

    def _reachable(self, timeout_s: float) -> bool:
        """After an outage: whether a broker answers a metadata request again."""
        try:
            self._consumer.list_topics(self.topic, timeout=timeout_s)
        except KafkaException as err:
            self._error("broker", f"{self._down}; still unreachable ({err})")
            if time.monotonic() - self._consumer_since > self.REOPEN_AFTER_S:
                self._reopen("no broker answers it")
            return False
        self._down = None
        self._reopen("a broker answers again")
        return True

    def _reopen(self, why: str) -> None:
        """A new consumer at the old one's positions, bootstrapping afresh. On a loaded
        machine a consumer that lived through a broker restart kept failing its metadata
        requests (``_TRANSPORT``) for over two minutes after the broker was back and
        answering new clients; so during an outage the consumer is replaced every
        ``REOPEN_AFTER_S``, and once more when a broker answers."""
        log.info("%s: %s; reading on with a fresh consumer", self.topic, why)
        self._check_caught_up()  # while the positions are still the old consumer's
        old, self._consumer = self._consumer, Consumer(self._config)
        self._consumer_since = time.monotonic()
        assigned = old.assignment()
        if assigned:
            positions = old.position(assigned)
            for tp in positions:
                if tp.offset < 0:  # nothing read yet: from the start, as first assigned
                    tp.offset = OFFSET_BEGINNING
            self._consumer.assign(positions)
        old.close()

    def _announcement(self, msg: Message) -> VersionAnnouncement | None:
        if msg.error():
            log.warning("%s consumer error: %s", self.topic, msg.error())
            self._error("consumer", str(msg.error()))
            return None
        if msg.key() != self.run.encode() or msg.value() is None:
            return None
        try:
            found = VersionAnnouncement.from_json(msg.value())
        except ValueError as err:
            log.warning(
                "ignoring a malformed announcement at %s-%d@%d: %s",
                msg.topic(),
                msg.partition(),
                msg.offset(),
                err,
            )
            self._error("malformed", str(err))
            return None
        if found.run != self.run:
            log.warning("ignoring an announcement of run %r keyed %r", found.run, self.run)
            self._error("malformed", f"run {found.run!r} under key {self.run!r}")
            return None
        return found

    def _error(self, kind: str, detail: str) -> None:
        if self.on_error is not None:
            self.on_error(kind, detail)

    def close(self) -> None:
        self._consumer.close()
