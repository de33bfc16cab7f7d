"""Reading rollstream topics back without moving anyone's offsets: what one record holds
(``ReplayRecord``), which records (``ReadBounds``, ``RecordFilter``) and the read itself
(``read_records``). ``rollstream replay`` / ``inspect`` / ``rerun`` / ``audit`` build on it.

Why: a loss spike, a burst of dead letters or a drop in reward is explained by the records
behind it; replay finds them, shows them token by token, exports them to Parquet, or runs
them again through a stream step or a trainer step (``rollstream.debug.rerun``).

**Never moves a role's offsets.** The consumer is *assigned* partitions (``assign``, never
``subscribe``) under a throwaway group id, with auto-commit and offset storing off: it
never joins a consumer group and never commits, so no group's committed offsets change
(``tests/integration/rollstream/test_replay.py`` checks the broker holds no offsets afterwards).

**Bounds, per partition** (``ReadBounds``): the start is ``--offset P:N`` for partition P,
else ``--from-offset N``, else the last ``--last N`` records, else the first offset whose
timestamp is at or after ``--from-time`` (``offsets_for_times``), else the beginning. The
end is ``--to-offset N`` (inclusive), the first offset at or after ``--to-time``, and never
beyond the end offsets seen when replay starts: it reads what exists and stops (it does
not follow the topic). With a time range, each record's own timestamp must also lie in
``[from, to)`` (producer timestamps need not grow with offsets). ``--offset`` without
``--partition`` reads only the partitions it names. Reads are ``read_committed``, as every
role's are: aborted transactional writes are not shown.

**Decoding** sniffs each value: a trajectory (``schemas.codec``), a scored group
(``schemas.group``), a version announcement (JSON, ``policy.versions``); anything else is
kept as *undecodable* with the decoder's reason. The ``rs-dead-letter`` (DLQ) and
``rs-stale`` headers are parsed, so one reader serves every topic.

**Filters** (``RecordFilter``) apply to the samples a record carries: a trajectory record
carries one, a scored group all of its samples. A record is selected when its Kafka key or
group matches the group filter and *at least one* sample passes every sample filter (run,
trajectory id, version range over the token segments, reward range, staleness range). A
sample's staleness is what the stream recorded: the scored group's diagnostics, or the
``rs-stale`` header on ``rollouts.stale``; raw and dead-lettered records carry none, so a
staleness filter excludes them. Announcements match on run and version. ``--limit`` counts
selected records.

**Parquet** (``--parquet FILE``): one row per Kafka record, see ``rollstream.debug.parquet``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import click

from core.topic_reader import ReadStalled, read_range, reader_config, topic_partitions, whole_topic

if TYPE_CHECKING:  # the schemas import pyarrow: imported when used, so --help stays instant
    from schemas.control import DeadLetter, StaleRecord, VersionAnnouncement
    from schemas.group import ScoredGroup
    from schemas.trajectory import Trajectory

log = logging.getLogger(__name__)

Headers = tuple[tuple[str, bytes | None], ...]
RecordKindName = Literal["trajectory", "scored_group", "announcement", "undecodable"]


# --- what one Kafka record holds ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReplayRecord:
    """One Kafka record, decoded as far as it goes."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    headers: Headers
    value: bytes | None
    trajectory: Trajectory | None = None
    group: ScoredGroup | None = None
    announcement: VersionAnnouncement | None = None
    error: str | None = None  # why the value is undecodable
    dead_letter: DeadLetter | None = None
    stale: StaleRecord | None = None
    notes: tuple[str, ...] = ()  # malformed control headers

    @property
    def kind(self) -> RecordKindName:
        if self.trajectory is not None:
            return "trajectory"
        if self.group is not None:
            return "scored_group"
        if self.announcement is not None:
            return "announcement"
        return "undecodable"

    @property
    def where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"

    def samples(self) -> list[tuple[Trajectory, int | None]]:
        """The trajectories carried, each with the staleness the stream recorded (or None)."""
        if self.trajectory is not None:
            return [(self.trajectory, self.stale.staleness if self.stale else None)]
        if self.group is not None:
            return [
                (t, d.staleness)
                for t, d in zip(self.group.samples, self.group.diagnostics, strict=True)
            ]
        return []

    def group_id(self) -> str | None:
        if self.group is not None:
            return self.group.group_id
        if self.trajectory is not None:
            return self.trajectory.group_id
        return self.key.decode(errors="replace") if self.key is not None else None


def decode_record(
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes | None]] | None,
) -> ReplayRecord:
    """Decode ``value`` by sniffing it, and parse the dead-letter and stale headers."""
    from schemas.codec import (
        DEAD_LETTER_HEADER,
        MAGIC,
        STALE_HEADER,
        DecodeError,
        RecordKind,
        decode,
        headers_to_dict,
    )
    from schemas.control import (
        DeadLetter,
        StaleRecord,
        VersionAnnouncement,
    )
    from schemas.group import decode_group

    fields: dict[str, Any] = {}
    notes: list[str] = []
    pairs: Headers = tuple((str(k), v) for k, v in (headers or ()))
    try:
        found = headers_to_dict(pairs)
    except DecodeError as err:
        found = {}
        notes.append(str(err))
    if found.get(DEAD_LETTER_HEADER) is not None:
        try:
            fields["dead_letter"] = DeadLetter.from_headers(pairs)
        except ValueError as err:
            notes.append(f"{DEAD_LETTER_HEADER}: {err}")
    if found.get(STALE_HEADER) is not None:
        try:
            fields["stale"] = StaleRecord.from_headers(pairs)
        except ValueError as err:
            notes.append(f"{STALE_HEADER}: {err}")
    data = value or b""
    try:
        if data[:4] == MAGIC and len(data) > 5 and data[5] == RecordKind.SCORED_GROUP:
            fields["group"] = decode_group(data)
        elif data[:1] == b"{":
            fields["announcement"] = VersionAnnouncement.from_json(data)
        else:
            fields["trajectory"] = decode(data)
    except ValueError as err:  # DecodeError is a ValueError, as are bad announcements
        fields["error"] = str(err)
    return ReplayRecord(
        topic, partition, offset, timestamp_ms, key, pairs, value, notes=tuple(notes), **fields
    )


# --- which records --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReadBounds:
    """Where to start and stop in each partition (see the module doc)."""

    partitions: tuple[int, ...] = ()  # empty: all (or those named by ``offsets``)
    offsets: tuple[tuple[int, int], ...] = ()  # (partition, start offset)
    from_offset: int | None = None
    last: int | None = None
    to_offset: int | None = None  # inclusive
    from_ms: int | None = None
    to_ms: int | None = None  # exclusive
    idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        given = [self.from_offset is not None, self.last is not None, self.from_ms is not None]
        if sum(given) > 1:
            raise ValueError("give at most one of --from-offset, --last and --from-time")
        if self.from_ms is not None and self.to_ms is not None and self.to_ms <= self.from_ms:
            raise ValueError("--to-time must be after --from-time")


@dataclasses.dataclass(frozen=True)
class RecordFilter:
    """Which records to keep (see the module doc for how samples and groups match)."""

    run: str | None = None
    groups: frozenset[str] = frozenset()
    trajectories: frozenset[str] = frozenset()
    min_version: int | None = None
    max_version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    min_staleness: int | None = None
    max_staleness: int | None = None
    reasons: frozenset[str] = frozenset()  # dead-letter reasons

    @property
    def filters_samples(self) -> bool:
        return any(
            v is not None
            for v in (
                self.run,
                self.min_version,
                self.max_version,
                self.min_reward,
                self.max_reward,
                self.min_staleness,
                self.max_staleness,
            )
        ) or bool(self.trajectories)

    def sample_matches(self, traj: Trajectory, staleness: int | None) -> bool:
        if self.run is not None and traj.run_id != self.run:
            return False
        if self.trajectories and traj.trajectory_id not in self.trajectories:
            return False
        if self.min_version is not None or self.max_version is not None:
            low = self.min_version if self.min_version is not None else -(2**63)
            high = self.max_version if self.max_version is not None else 2**63 - 1
            versions = traj.segment_versions
            if not any(low <= int(v) <= high for v in versions):
                return False
        if self.min_reward is not None and not traj.reward >= self.min_reward:
            return False
        if self.max_reward is not None and not traj.reward <= self.max_reward:
            return False
        if self.min_staleness is not None or self.max_staleness is not None:
            if staleness is None:
                return False
            if self.min_staleness is not None and staleness < self.min_staleness:
                return False
            if self.max_staleness is not None and staleness > self.max_staleness:
                return False
        return True

    def matches(self, record: ReplayRecord) -> bool:
        if self.reasons and (
            record.dead_letter is None or record.dead_letter.reason not in self.reasons
        ):
            return False
        if record.announcement is not None:
            return self._announcement_matches(record.announcement)
        if self.groups and record.group_id() not in self.groups:
            return False
        if not self.filters_samples:
            return True
        return any(self.sample_matches(t, s) for t, s in record.samples())

    def _announcement_matches(self, ann: VersionAnnouncement) -> bool:
        if self.groups or self.trajectories or self.min_reward is not None:
            return False
        if self.max_reward is not None or self.min_staleness is not None:
            return False
        if self.max_staleness is not None:
            return False
        if self.run is not None and ann.run != self.run:
            return False
        if self.min_version is not None and ann.version < self.min_version:
            return False
        return self.max_version is None or ann.version <= self.max_version


# --- reading Kafka without a consumer group ---------------------------------------------------


def plan_partitions(consumer: Any, topic: str, bounds: ReadBounds) -> dict[int, tuple[int, int]]:
    """``partition -> (start, end)`` offsets to read, ``end`` exclusive."""
    from confluent_kafka import KafkaException

    try:
        existing = topic_partitions(consumer, topic)
    except KafkaException as err:
        raise click.ClickException(f"topic {topic!r} cannot be read: {err.args[0]}") from err
    starts = dict(bounds.offsets)
    wanted = list(bounds.partitions) or (sorted(starts) if starts else existing)
    unknown = sorted(set(wanted) - set(existing))
    if unknown:
        raise click.ClickException(f"{topic} has partitions {existing}, not {unknown}")
    plan: dict[int, tuple[int, int]] = {}
    for p, (low, high) in whole_topic(consumer, topic, wanted).items():
        if p in starts:
            start = starts[p]
        elif bounds.from_offset is not None:
            start = bounds.from_offset
        elif bounds.last is not None:
            start = high - bounds.last  # a first guess: markers take offsets (see read_records)
        elif bounds.from_ms is not None:
            start = _offset_at(consumer, topic, p, bounds.from_ms, high)
        else:
            start = low
        end = high
        if bounds.to_offset is not None:
            end = min(end, bounds.to_offset + 1)
        if bounds.to_ms is not None:
            end = min(end, _offset_at(consumer, topic, p, bounds.to_ms, high))
        plan[p] = (max(start, low), end)
    return plan


def _offset_at(consumer: Any, topic: str, partition: int, ms: int, high: int) -> int:
    """First offset whose timestamp is at or after ``ms`` (``high`` if none)."""
    from confluent_kafka import TopicPartition

    (found,) = consumer.offsets_for_times([TopicPartition(topic, partition, ms)], timeout=30)
    if found.error is not None:
        raise click.ClickException(f"offsets_for_times({topic}[{partition}]): {found.error}")
    return high if found.offset < 0 else found.offset


def read_records(
    client_config: Mapping[str, str],
    topic: str,
    bounds: ReadBounds,
    keys: frozenset[bytes] | None = None,
) -> Iterator[ReplayRecord]:
    """Every record of ``topic`` inside ``bounds`` (and with a key in ``keys``, checked
    before decoding), each partition in offset order (partitions interleave). Stops at the
    planned ends, or after ``idle_timeout_s`` without progress (a transaction left open
    keeps records invisible), with a warning."""
    from confluent_kafka import Consumer

    consumer = Consumer(reader_config(client_config, "replay"))
    try:
        plan = plan_partitions(consumer, topic, bounds)
        if bounds.last is not None:
            messages = _last_records(client_config, topic, plan, bounds)
        else:
            messages = read_range(consumer, topic, plan, bounds.idle_timeout_s)
        for msg in messages:
            _ts_type, ts = msg.timestamp()
            if _in_time_range(ts, bounds) and (keys is None or msg.key() in keys):
                p, offset = msg.partition(), msg.offset()
                assert p is not None and offset is not None
                yield decode_record(topic, p, offset, ts, msg.key(), msg.value(), msg.headers())
    except ReadStalled as stalled:
        log.warning("%s; stopping", stalled)
    finally:
        consumer.close()  # no commit: enable.auto.commit is off and nothing was stored


def _last_records(
    client_config: Mapping[str, str],
    topic: str,
    plan: Mapping[int, tuple[int, int]],
    bounds: ReadBounds,
) -> Iterator[Any]:
    """The last ``bounds.last`` records before each partition's planned end.

    Transaction markers take offsets but are never delivered, so ``end - N`` can hold fewer
    than N records: the window is doubled until it holds N or reaches the log start."""
    from confluent_kafka import Consumer

    assert bounds.last is not None
    wanted = bounds.last
    for partition, (start, end) in sorted(plan.items()):
        window = max(1, end - start)
        while True:
            consumer = Consumer(reader_config(client_config, "replay"))
            try:
                low = consumer.get_watermark_offsets(_tp(topic, partition), timeout=30)[0]
                first = max(low, end - window)
                chunk = {partition: (first, end)}
                found = list(read_range(consumer, topic, chunk, bounds.idle_timeout_s))
            finally:
                consumer.close()
            if len(found) >= wanted or first <= low:
                break
            window *= 2
        yield from found[-wanted:] if wanted else []


def _tp(topic: str, partition: int) -> Any:
    from confluent_kafka import TopicPartition

    return TopicPartition(topic, partition)


def _in_time_range(ts: int, bounds: ReadBounds) -> bool:
    if bounds.from_ms is not None and ts < bounds.from_ms:
        return False
    return bounds.to_ms is None or ts < bounds.to_ms


def select(
    records: Iterator[ReplayRecord], record_filter: RecordFilter, limit: int | None = None
) -> list[ReplayRecord]:
    """The records that pass ``record_filter``, at most ``limit`` of them."""
    chosen: list[ReplayRecord] = []
    try:
        for record in records:
            if limit is not None and len(chosen) >= limit:
                break
            if record_filter.matches(record):
                chosen.append(record)
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()  # a generator from read_records closes its consumer now
    return chosen
