"""What ``rollstream audit`` reads: the producers' delivery ledgers (or ``rollouts.raw``),
the trainer's ledger, the ids each topic holds and how far the stream and the trainer
got; ``AuditSources`` names where one run keeps them. ``rollstream.runs.audit`` reconciles
them (its docstring says what each source tells)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from core.topic_reader import read_whole_topic, reader_config
from rollstream.config.settings import RollstreamConfig
from schemas.codec import RUN_ID_HEADER, TRAJECTORY_ID_HEADER

if TYPE_CHECKING:
    from confluent_kafka import Message


# --- the producers' side -----------------------------------------------------------------


@dataclass
class Produced:
    """What the producer ledgers of one run say, merged over producers."""

    producers: int = 0
    delivered: dict[str, list[str]] = field(default_factory=dict)  # group id -> ids
    orphaned: dict[str, list[str]] = field(default_factory=dict)  # ids that reached raw
    lost: set[str] = field(default_factory=set)  # group ids, none of it reached raw
    pending: dict[str, list[str]] = field(default_factory=dict)  # unsettled by the producer
    dead_lettered: dict[str, list[str]] = field(default_factory=dict)  # group id -> ids in DLQ
    abandoned: dict[str, str] = field(default_factory=dict)  # gateway episode id -> why
    episode_calls: dict[str, int] = field(default_factory=dict)  # episode id -> committed calls
    interrupted: set[str] = field(default_factory=set)  # episodes with calls nothing settled

    @property
    def delivered_ids(self) -> set[str]:
        return {tid for ids in self.delivered.values() for tid in ids}

    @property
    def orphaned_ids(self) -> set[str]:
        return {tid for ids in self.orphaned.values() for tid in ids}

    @property
    def dead_lettered_ids(self) -> set[str]:
        return {tid for ids in self.dead_lettered.values() for tid in ids}

    def settle_pending(self, raw_ids: Iterable[str]) -> int:
        """Settle ``pending`` groups against the ids found in the raw topic, as the
        producer's recovery would (all found: delivered, some: orphaned, none: lost);
        returns how many were settled."""
        present = set(raw_ids)
        settled = len(self.pending)
        for group_id, ids in self.pending.items():
            found = [tid for tid in ids if tid in present]
            if len(found) == len(ids):
                self.delivered[group_id] = ids
            elif found:
                self.orphaned[group_id] = found
            else:
                self.lost.add(group_id)
        self.pending = {}
        return settled


def produced_from_raw(raw: TopicView) -> Produced:
    """What the producers delivered, told by the raw topic itself (no ledger files): a
    group whose G samples are all there was delivered, a group with fewer was left partly
    by a crash (orphaned). Serves a run whose producers ran on other machines; it cannot
    see records Kafka acknowledged and then lost, which the ledgers can."""
    produced = Produced(producers=len(raw.producers))
    for group_id, ids in raw.groups.items():
        found = sorted(ids)
        if len(found) == raw.group_sizes[group_id]:
            produced.delivered[group_id] = found
        else:
            produced.orphaned[group_id] = found
    return produced


def producers_dir(config: RollstreamConfig) -> Path:
    """Where ``rollstream produce`` keeps the ledgers of ``config.run_id`` (one per producer),
    of the config's policy in a multi-policy run (a producer keeps one per policy it feeds)."""
    run = Path(config.state_dir) / "producers" / config.run_id
    return run / config.policy if config.policy else run


def read_producer_ledgers(directory: Path) -> Produced:
    """Fold every ``<producer_id>/ledger.jsonl`` under ``directory`` (a torn last line is
    ignored, as the producer itself would)."""
    from producers.rollout.ledger import LEDGER_NAME, read_ledger

    produced = Produced()
    for path in sorted(Path(directory).glob(f"*/{LEDGER_NAME}")):
        state = read_ledger(path)
        produced.producers += 1
        produced.delivered.update(state.delivered)
        produced.orphaned.update(state.orphaned)
        produced.lost |= state.lost
        produced.pending.update({g: p.trajectory_ids for g, p in state.pending.items()})
        produced.dead_lettered.update(state.dead_lettered)
        produced.abandoned.update(state.abandoned_episodes)
        for episodes in state.episode_calls.values():
            produced.episode_calls.update(episodes)
        produced.interrupted |= {e for eps in state.interrupted().values() for e in eps}
    return produced


def read_trainer_ledger(path: Path) -> Counter[str]:
    """How many times each trajectory id was trained, per the trainer's ledger."""
    from consumers.checkpoint import TrainingLedger

    return Counter(tid for _, ids in TrainingLedger.read(path) for tid in ids)


def read_trainer_rolled_back(path: Path) -> tuple[Counter[str], list[str]]:
    """Ids trained into steps a guard's rollback discarded, and malformed rollback lines
    (``TrainingLedger.rolled_back_ids``)."""
    from consumers.checkpoint import TrainingLedger

    return TrainingLedger.rolled_back_ids(path)


def read_trainer_refused(path: Path) -> Counter[str]:
    """How many times the trainer refused each sample id's group as already trained."""
    from consumers.checkpoint import TrainingLedger

    return Counter(TrainingLedger.read_refused(path))


# --- the topics --------------------------------------------------------------------------


def read_topic(
    client_config: Mapping[str, str], topic: str, timeout_s: float = 60.0
) -> Iterator[Message]:
    """Every committed record of ``topic`` up to the end offsets seen at the start.

    Raises ``ReadStalled`` (a ``TimeoutError``) if the end is not reached within
    ``timeout_s`` of no progress (a transaction left open keeps ``read_committed``
    readers before it)."""
    return read_whole_topic(client_config, topic, "audit", timeout_s)


def _headers(msg: Message) -> dict[str, bytes]:
    return {k: v for k, v in (msg.headers() or []) if v is not None}


def _record_ids(msg: Message, run_id: str) -> list[str] | None:
    """Trajectory ids a record carries if it belongs to ``run_id`` ([] when it does not),
    None when they cannot be told (undecodable, no headers)."""
    from schemas.codec import DecodeError, decode
    from schemas.group import decode_group

    headers = _headers(msg)
    run = headers.get(RUN_ID_HEADER)
    if TRAJECTORY_ID_HEADER in headers:
        if run is not None and run.decode(errors="replace") != run_id:
            return []
        return [headers[TRAJECTORY_ID_HEADER].decode(errors="replace")]
    value = msg.value() or b""
    with contextlib.suppress(DecodeError):
        group = decode_group(value)
        return [s.trajectory_id for s in group.samples] if group.run_id == run_id else []
    with contextlib.suppress(DecodeError):
        traj = decode(value)
        return [traj.trajectory_id] if traj.run_id == run_id else []
    return None


@dataclass
class TopicView:
    """The trajectory ids of one run found in a topic, with counts and (sinks) reasons."""

    topic: str
    ids: Counter[str] = field(default_factory=Counter)
    reasons: dict[str, str] = field(default_factory=dict)  # id -> DLQ reason / "stale:<n>"
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (partition, offset)
    # raw records only (``read_ids(groups=True)``): group membership and who produced them
    groups: dict[str, set[str]] = field(default_factory=dict)
    group_sizes: dict[str, int] = field(default_factory=dict)
    producers: set[str] = field(default_factory=set)
    records: int = 0
    unidentified: int = 0  # records of unknown run whose ids could not be read
    # dead letters only: id -> the source records (topic, partition, offset) of its letters
    origins: dict[str, Counter[tuple[str, int, int]]] = field(default_factory=dict)

    def reason_counts(self) -> Counter[str]:
        """How many ids each reason (DLQ reason, operator:reason) holds."""
        return Counter(self.reasons.get(tid, "?") for tid in self.ids)

    def copies(self) -> Counter[str]:
        """How many distinct records each id came in: a dead letter counts its source
        record, so one record dead-lettered again (a trainer re-reading it after a crash)
        counts once, while two records of one id (a re-send) count twice."""
        return Counter(
            {
                tid: len(self.origins[tid]) if tid in self.origins else n
                for tid, n in self.ids.items()
            }
        )

    def merge(self, other: TopicView) -> None:
        """Add ``other``'s records (another topic of the same sink)."""
        self.ids.update(other.ids)
        self.reasons.update(other.reasons)
        self.positions.update(other.positions)
        for tid, sources in other.origins.items():
            self.origins.setdefault(tid, Counter()).update(sources)
        self.records += other.records
        self.unidentified += other.unidentified


def read_ids(
    client_config: Mapping[str, str],
    topic: str,
    run_id: str,
    timeout_s: float = 60.0,
    groups: bool = False,
) -> TopicView:
    """The ids of ``run_id`` in ``topic`` (trajectory records, scored groups, dead letters
    of either kind, stale records), with the reason of each dead letter or stale record.
    ``groups``: decode trajectory records for their group and producer too (raw)."""
    from schemas.codec import (
        DEAD_LETTER_HEADER,
        FILTERED_HEADER,
        STALE_HEADER,
        DecodeError,
        decode,
    )
    from schemas.control import (
        DeadLetter,
        FilteredGroup,
        StaleRecord,
    )

    view = TopicView(topic)
    for msg in read_topic(client_config, topic, timeout_s):
        view.records += 1
        ids = _record_ids(msg, run_id)
        if ids is None:
            view.unidentified += 1
            continue
        headers = _headers(msg)
        reason = None
        source = None
        if DEAD_LETTER_HEADER in headers:
            letter = DeadLetter.from_json(headers[DEAD_LETTER_HEADER])
            reason = letter.reason
            source = (letter.source_topic, letter.partition, letter.offset)
        elif STALE_HEADER in headers:
            reason = f"stale:{StaleRecord.from_json(headers[STALE_HEADER]).staleness}"
        elif FILTERED_HEADER in headers:
            filtered = FilteredGroup.from_json(headers[FILTERED_HEADER])
            reason = f"{filtered.operator}:{filtered.reason}"
        for tid in ids:
            view.ids[tid] += 1
            view.positions[tid] = (msg.partition(), msg.offset())
            if reason is not None:
                view.reasons[tid] = reason
            if source is not None:
                view.origins.setdefault(tid, Counter())[source] += 1
        if groups and ids:
            with contextlib.suppress(DecodeError):
                traj = decode(msg.value() or b"")
                view.groups.setdefault(traj.group_id, set()).add(traj.trajectory_id)
                view.group_sizes[traj.group_id] = traj.group_size
                view.producers.add(traj.producer_id)
    return view


# --- how far the stream and the trainer got ----------------------------------------------


@dataclass
class Progress:
    """Where the stream and the trainer stand, to tell records in flight from lost ones.

    A raw record the stream has not applied yet (past its table's watermark) or whose
    group is still open in its table is in flight in the stream; a scored group past the
    trainer's committed offset is in flight in the trainer. Anything else without an
    outcome is lost."""

    stream_applied: dict[int, int] = field(default_factory=dict)  # raw partition -> offset
    open_group_ids: set[str] = field(default_factory=set)
    trainer_committed: dict[int, int] = field(default_factory=dict)  # scored partition -> next

    def in_stream(self, position: tuple[int, int], tid: str) -> bool:
        partition, offset = position
        return offset > self.stream_applied.get(partition, -1) or tid in self.open_group_ids

    def in_trainer(self, position: tuple[int, int]) -> bool:
        partition, offset = position
        return offset >= self.trainer_committed.get(partition, 0)


def read_progress(
    client_config: Mapping[str, str],
    app_id: str,
    raw: str,
    trainer_group: str,
    scored: str,
    timeout_s: float = 60.0,
) -> Progress:
    """The stream's applied watermarks and open groups (its table's changelog) and the
    trainer group's committed offsets on ``scored``."""
    from confluent_kafka import Consumer, TopicPartition

    from core.topic_reader import committed_offsets, topic_partitions
    from streams.faust.table_view import read_table

    table = read_table(client_config, app_id, timeout_s)
    consumer = Consumer(reader_config(client_config, "audit-progress"))
    try:
        raw_partitions = topic_partitions(consumer, raw)
        parts = [TopicPartition(scored, p) for p in topic_partitions(consumer, scored)]
    finally:
        consumer.close()
    trainer = Consumer({**client_config, "group.id": trainer_group, "enable.auto.commit": False})
    try:
        committed = {tp.partition: tp.offset for tp in committed_offsets(trainer, parts)}
    finally:
        trainer.close()
    return Progress(
        stream_applied=table.applied(raw, raw_partitions),
        open_group_ids={s.trajectory_id for g in table.open_groups() for s in g.samples},
        trainer_committed={p: o for p, o in committed.items() if o >= 0},
    )


@dataclass(frozen=True)
class AuditSources:
    """Where one run's records live: the ledgers and the topic names."""

    run_id: str
    client_config: Mapping[str, str]
    producers_dir: Path
    trainer_ledger: Path
    raw: str
    scored: str
    stales: tuple[str, ...]  # the stream's and the trainer's (often one topic)
    dlqs: tuple[str, ...]  # the stream's, the trainer's and a gateway's (often one topic)
    filtered: str | None  # what the stream's data operators filtered out
    stream_app_id: str
    trainer_group: str

    @classmethod
    def from_config(cls, config: RollstreamConfig) -> AuditSources:
        """The sources of a resolved config (Kafka address known)."""
        from consumers.config import ledger_path

        ledger = ledger_path(config, config.trainer)
        topics = config.streams.topics
        return cls(
            run_id=config.run_id,
            client_config=config.kafka.client_config(),
            producers_dir=producers_dir(config),
            trainer_ledger=Path(ledger),
            raw=config.producers.rollout.topic,
            scored=topics.scored,
            stales=tuple(dict.fromkeys((topics.stale, config.trainer.topics.stale))),
            dlqs=tuple(
                dict.fromkeys((topics.dlq, config.trainer.topics.dlq, *config.gateway_dlq_topics()))
            ),
            filtered=topics.filtered,
            stream_app_id=config.streams.app_id,
            trainer_group=config.trainer.topics.group_id,
        )


Delivery = Literal["auto", "ledgers", "topic"]


def read_sinks(
    client_config: Mapping[str, str], topics: tuple[str, ...], run_id: str, timeout_s: float
) -> TopicView:
    """One view of a sink the stream and the trainer may each name differently (stale,
    dead letters): the ids of ``run_id`` in all of ``topics``."""
    view = TopicView(",".join(topics))
    for topic in topics:
        view.merge(read_ids(client_config, topic, run_id, timeout_s))
    return view
