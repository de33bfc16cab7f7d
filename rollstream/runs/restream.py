"""``rollstream fork --restream``: a run's raw topic through the stream again, with the
fork's stream settings, into the fork's own scored topic.

The recorded raw records of RUN go, in the order of their timestamps, through the stream
worker's own logic (``rollstream.debug.rerun.StreamReplay``: the worker's ``Processor``)
configured with the fork's ``[streams]``: its validation, staleness window, group settings
and data operators. Old logits: with the fork's ``[streams.old_logits]`` equal to RUN's,
each sample gets the ones RUN's stream attached (read from RUN's scored topic: the same
settings give the same numbers, and RUN's store may no longer hold the versions); with
``mode = "off"`` none; with other settings they are recomputed from RUN's published
weights, which must then still hold every generating version. The staleness clock is
replayed from RUN's announcements: a record is judged against the newest version RUN had
announced when the record was written. Timers fire every quarter of the group timeout of
recorded time, and the groups still open at the end close as their timeout would.

What the stream emits for the scored topic is written, in one Kafka transaction, to
``<scored topic>.fork.<NEW>``; what it would route elsewhere (stale, dead-lettered,
filtered, prompt statistics) is counted, not written. Nothing of RUN's is written.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollstream.config.settings import RollstreamConfig

if TYPE_CHECKING:
    import numpy as np

    from schemas.trajectory import Trajectory
    from streams.processor import Message

log = logging.getLogger(__name__)


def restream_topic(scored: str, fork: str) -> str:
    """The fork's own scored topic."""
    return f"{scored}.fork.{fork}"


@dataclass
class RestreamResult:
    """What a restream read and wrote."""

    topic: str
    records: int = 0
    groups: int = 0
    samples: int = 0
    set_aside: dict[str, int] = field(default_factory=dict)  # by output topic
    open_groups: int = 0
    old_logits: str = "recorded"  # recorded (RUN's), off, or recomputed

    def summary(self) -> str:
        aside = ", ".join(f"{n} to {t}" for t, n in sorted(self.set_aside.items())) or "nothing"
        return (
            f"restreamed {self.records} raw records: {self.groups} groups ({self.samples} "
            f"samples, old logits {self.old_logits}) into {self.topic}; set aside (not "
            f"written): {aside}"
        )


@dataclass
class RecordedOldLogits:
    """RUN's stream's old logits, by sample id, attached as it attached them."""

    by_id: dict[str, tuple[np.ndarray | None, str]]

    @classmethod
    def read(
        cls, client_config: Mapping[str, str], topic: str, run: str, timeout_s: float
    ) -> RecordedOldLogits:
        from consumers.fork import recorded_samples

        by_id: dict[str, tuple[np.ndarray | None, str]] = {}
        for sample in recorded_samples(client_config, topic, run, "fork-old-logits", timeout_s):
            by_id.setdefault(sample.trajectory_id, (sample.logp_old, sample.old_logits_status))
        return cls(by_id)

    def attach(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """Copies carrying RUN's old logits; a sample RUN never scored gets none."""
        from schemas.trajectory import OldLogitsStatus

        attached = []
        for traj in trajectories:
            logp, status = self.by_id.get(traj.trajectory_id, (None, OldLogitsStatus.MISSING.value))
            if logp is None:
                attached.append(dataclasses.replace(traj, logp_old=None, old_logits_status=status))
            else:
                attached.append(traj.with_old_logits(logp, status))
        return attached


def check_versions_held(
    config: RollstreamConfig, run: str, raw: Sequence[tuple[int, Message]]
) -> None:
    """``ValueError`` naming the generating versions RUN's store no longer holds."""
    from rollstream.debug.rerun import resolved_s3
    from schemas.codec import DecodeError, parse_headers
    from weights.store import WeightStore

    needed: set[int] = set()
    for _, msg in raw:
        try:
            routing = parse_headers(msg.headers)
        except DecodeError:
            continue
        needed.update(range(max(routing.min_version, 0), routing.max_version + 1))
    store = WeightStore.from_config(resolved_s3(config), run, config.policy)
    gone = sorted(needed - set(store.versions()))
    if gone:
        raise ValueError(
            f"old logits with other settings are recomputed from run {run}'s weights, and "
            f"its store no longer holds {len(gone)} generating versions ({gone[:5]}...; "
            "[weights] keep_versions pruned them)"
        )


def version_timeline(
    client_config: Mapping[str, str], topic: str, run: str, timeout_s: float
) -> list[tuple[int, int]]:
    """``(published_at_ms, version)`` of every version RUN announced on ``topic``, in order."""
    from core.topic_reader import read_whole_topic
    from schemas.control import VersionAnnouncement

    timeline = []
    for msg in read_whole_topic(client_config, topic, "fork-versions", timeout_s):
        try:
            announced = VersionAnnouncement.from_json(msg.value() or b"")
        except (ValueError, TypeError):
            continue  # not an announcement: the trainer never acted on it either
        if announced.run == run:
            timeline.append((announced.published_at_ms, announced.version))
    return sorted(timeline)


def raw_messages(
    client_config: Mapping[str, str], topic: str, run: str, timeout_s: float
) -> list[tuple[int, Message]]:
    """RUN's records of its raw topic as the stream receives them, with their timestamps,
    in the order the restream feeds them (time, then partition and offset)."""
    from core.topic_reader import read_whole_topic
    from schemas.codec import RUN_ID_HEADER
    from streams.processor import Message

    raw: list[tuple[int, Message]] = []
    for msg in read_whole_topic(client_config, topic, "fork-raw", timeout_s):
        headers = tuple((k, v or b"") for k, v in msg.headers() or [])
        if dict(headers).get(RUN_ID_HEADER, run.encode()) != run.encode():
            continue  # another run's record (one without the header goes to the stream)
        message = Message(
            msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), headers
        )
        raw.append((msg.timestamp()[1], message))
    raw.sort(key=lambda item: (item[0], item[1].partition, item[1].offset))
    return raw


def restream(
    recorded: RollstreamConfig,
    forked: RollstreamConfig,
    client_config: Mapping[str, str],
    timeout_s: float = 60.0,
) -> RestreamResult:
    """Restream RUN's raw topic with the fork's stream settings (see the module doc);
    the scored groups are committed to the fork's topic, or nothing is."""
    from rollstream.debug.rerun import StreamReplay
    from streams.staleness import VersionTracker

    run, streams = recorded.run_id, forked.streams
    result = RestreamResult(restream_topic(recorded.trainer.topics.scored, forked.run_id))
    timeline = version_timeline(client_config, recorded.streams.topics.versions, run, timeout_s)
    newest = max((v for _, v in timeline), default=None)
    raw = raw_messages(client_config, recorded.streams.topics.raw, run, timeout_s)
    engine: RecordedOldLogits | None = None
    if forked.streams.old_logits == recorded.streams.old_logits:
        scored_topic = recorded.trainer.topics.scored
        engine = RecordedOldLogits.read(client_config, scored_topic, run, timeout_s)
    elif streams.old_logits.mode == "off":
        result.old_logits = "off"
    else:
        result.old_logits = "recomputed"
        if streams.old_logits.source != "seeded":
            check_versions_held(forked, run, raw)
    tracker = VersionTracker()
    replay = StreamReplay(forked, run, tracker, engine)
    tick_every_ms = max(int(streams.groups.timeout_s * 250), 1)
    announced = 0
    last_tick_ms = raw[0][0] if raw else 0
    scored: list[tuple[bytes | None, bytes, tuple[tuple[str, bytes], ...]]] = []
    aside: Counter[str] = Counter()

    def keep(sends: list) -> None:
        for send in sends:
            if send.topic == streams.topics.scored:
                scored.append((send.key, send.value, send.headers))
            else:
                aside[send.topic] += 1

    for ts, msg in raw:
        while announced < len(timeline) and timeline[announced][0] <= ts:
            tracker.observe(timeline[announced][1])
            announced += 1
        if ts - last_tick_ms >= tick_every_ms:
            for partition in sorted(replay.processor.due_partitions(ts)):
                keep(replay.tick(partition, ts).sends)
            last_tick_ms = ts
        claimed = replay.processor.unannounced_version(msg)
        if claimed is not None and newest is not None and claimed <= newest:
            tracker.vouch(claimed)  # RUN published it: its announcement came a little later
        keep(replay.step(msg, ts).sends)
        result.records += 1
    for _, step in replay.flush(raw[-1][0] if raw else 0):
        keep(step.sends)
    result.open_groups = len(replay.open_states())
    result.set_aside = dict(aside)
    if not scored:
        raise ValueError(
            f"{result.summary()}: no scored group of run {run} from "
            f"{recorded.streams.topics.raw} with these stream settings"
        )
    _write_transactionally(forked, client_config, result.topic, scored)
    result.groups = len(scored)
    result.samples = _count_samples(scored)
    return result


def _count_samples(scored: list[tuple[bytes | None, bytes, tuple[tuple[str, bytes], ...]]]) -> int:
    from schemas.group import decode_group

    return sum(len(decode_group(value).samples) for _, value, _ in scored)


def _write_transactionally(
    forked: RollstreamConfig,
    client_config: Mapping[str, str],
    topic: str,
    records: list[tuple[bytes | None, bytes, tuple[tuple[str, bytes], ...]]],
) -> None:
    """Create the fork's topic and write ``records`` to it in one transaction; an error
    aborts it (a later restream's transaction fences one left open by a killed one)."""
    from confluent_kafka import Producer

    from infra.topics import ensure_topics
    from schemas.topics import ROLLOUTS_SCORED, TopicSpec, producer_limits

    spec = TopicSpec(topic, partitions=1, max_message_bytes=ROLLOUTS_SCORED.max_message_bytes)
    ensure_topics(client_config, [spec], kafka=forked.kafka)
    producer = Producer(
        {
            **client_config,
            **producer_limits(spec),
            "transactional.id": f"rollstream-restream-{topic}",
        }
    )
    producer.init_transactions(60)
    producer.begin_transaction()
    try:
        for key, value, headers in records:
            while True:
                try:
                    producer.produce(topic, value=value, key=key, headers=list(headers))
                    break
                except BufferError:  # the local queue is full: let it drain
                    producer.poll(0.5)
            producer.poll(0)
        producer.commit_transaction(120)
    except BaseException:
        producer.abort_transaction(60)
        raise
    log.info("wrote %d scored groups to %s", len(records), topic)
