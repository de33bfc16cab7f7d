"""``rollstream audit``: reconcile what the producers delivered with what became of it.

Why: the pipeline promises that every trajectory a producer delivered is either trained
exactly once, filtered as stale, dead-lettered with a reason, or filtered out by a data
operator (``rollouts.filtered``, ``rs-filtered`` header), and that nothing is
trained that no producer produced. Each role keeps its own record of its side:

- the producers' delivery ledgers (``producers.ledger``, one per producer under
  ``<state_dir>/producers/<run_id>/``): trajectory ids of every group whose G records
  Kafka acknowledged (*delivered*), and of groups a crash left partly in the topic
  (*orphaned*; the stream closes them as partial groups or dead-letters them), and gateway
  episodes a stopping producer dead-lettered itself (*dead-lettered by producers*, expected
  in the DLQ like delivered ids, never in raw). Producers
  on other machines: the same sets are told by ``rollouts.raw`` itself
  (``produced_from_raw``, ``--delivery topic``);
- the trainer's ledger (``trainer.ledger_file``): trajectory ids per trainer step whose
  gradient is in the latest durable checkpoint, each once per time it was trained, and a
  stability guard's rollbacks (``consumers.guards``): the ids of the steps a rollback
  discarded are *trained, then rolled back*: trained once (their outcome), never again;
- the topics: ``rollouts.stale`` (``rs-stale`` header), ``rollouts.dlq`` (the stream's and
  the trainer's dead letters, ``rs-dead-letter`` header; a dead-lettered scored group is
  decoded for its sample ids), ``rollouts.scored`` and ``rollouts.raw`` for diagnosis.

Topics are read from the beginning to the end offsets seen at the start, ``read_committed``
(as the trainer reads them: aborted transactions of killed stream workers are invisible),
by assigned partitions under a throwaway group id that never commits.

A ``pending`` group left in a producer ledger (the producer was killed and not restarted)
is settled here the way the producer's own recovery would: by finding its records in
``rollouts.raw``; the ledger file is not modified.

The verdict (``AuditReport.problems``), counted per id, not as sets: delivered but
without an outcome (*missing*); more than one outcome (trained more than once, or trained
and also stale, filtered or dead-lettered, or dead-lettered and also stale or filtered);
dead-lettered from more than one record; in ``rollouts.raw`` or ``rollouts.scored`` more
than once (in flight or not); read again by the trainer after it was trained (refused
there, listed in its ledger); trained but never produced; and records the progress views
would call in flight although a later record of their partition already has an outcome
(*lost in flight*). A stale group routed twice is one decision told twice (a trainer
restart) and is counted once. Ids dead-lettered that no ledger knows are listed too (a
record from outside the producers), but are not a loss.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click

from core.topic_reader import read_whole_topic, reader_config
from rollstream.config import RollstreamConfig

if TYPE_CHECKING:
    from confluent_kafka import Message

TRAJECTORY_HEADER = "rs-trajectory-id"
RUN_HEADER = "rs-run-id"


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
    from producers.ledger import LEDGER_NAME, read_ledger

    produced = Produced()
    for path in sorted(Path(directory).glob(f"*/{LEDGER_NAME}")):
        state = read_ledger(path)
        produced.producers += 1
        produced.delivered.update(state.delivered)
        produced.orphaned.update(state.orphaned)
        produced.lost |= state.lost
        produced.pending.update({g: p.trajectory_ids for g, p in state.pending.items()})
        produced.dead_lettered.update(state.dead_lettered)
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
    run = headers.get(RUN_HEADER)
    if TRAJECTORY_HEADER in headers:
        if run is not None and run.decode(errors="replace") != run_id:
            return []
        return [headers[TRAJECTORY_HEADER].decode(errors="replace")]
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
    from schemas.codec import DecodeError, decode
    from schemas.control import (
        DEAD_LETTER_HEADER,
        FILTERED_HEADER,
        STALE_HEADER,
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
    from streams.table_view import read_table

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


# --- the verdict -------------------------------------------------------------------------


@dataclass
class AuditReport:
    """Every set the reconciliation is made of, and what is wrong with them."""

    run_id: str
    produced: Produced
    trained: Counter[str]
    stale: TopicView
    dlq: TopicView
    filtered: TopicView = field(default_factory=lambda: TopicView(""))
    scored: TopicView | None = None
    raw: TopicView | None = None
    progress: Progress | None = None
    delivery: str = "ledgers"  # where ``produced`` came from: ledgers | topic
    # sample ids of groups the trainer read again after training them, and refused
    refused: Counter[str] = field(default_factory=Counter)
    # ids trained into steps a guard rolled back (still trained: their gradient was
    # discarded and they are not trained again), and malformed rollback lines
    rolled_back: Counter[str] = field(default_factory=Counter)
    rollback_problems: list[str] = field(default_factory=list)

    @property
    def delivered(self) -> set[str]:
        return self.produced.delivered_ids

    @property
    def accounted(self) -> set[str]:
        """Ids with an outcome: trained, stale, dead-lettered, or filtered by a data
        operator."""
        return set(self.trained) | set(self.stale.ids) | set(self.dlq.ids) | set(self.filtered.ids)

    @property
    def missing(self) -> set[str]:
        """Delivered (or dead-lettered by a producer), yet neither trained, stale nor
        dead-lettered, nor in flight: lost
        (``lost_in_flight`` included). Without the raw and scored views (``--quick``)
        records in flight count too."""
        expected = self.delivered | self.produced.dead_lettered_ids
        return expected - self.accounted - self.unprocessed - self.untrained

    @property
    def trained_twice(self) -> dict[str, int]:
        return {tid: n for tid, n in self.trained.items() if n > 1}

    @property
    def unproduced(self) -> set[str]:
        """Trained, but no producer ledger has it as delivered or orphaned."""
        return set(self.trained) - self.delivered - self.produced.orphaned_ids

    @property
    def trained_and_stale(self) -> set[str]:
        return set(self.trained) & set(self.stale.ids)

    @property
    def trained_and_filtered(self) -> set[str]:
        return set(self.trained) & set(self.filtered.ids)

    @property
    def trained_and_dead_lettered(self) -> set[str]:
        """Two outcomes for one id: a re-sent copy the stream dead-lettered as a duplicate
        or late sample while the first copy trained."""
        return set(self.trained & self.dlq.ids)

    @property
    def dead_lettered_and_set_aside(self) -> set[str]:
        """Dead-lettered and also stale or filtered: two outcomes, neither trained."""
        return set(self.dlq.ids & (self.stale.ids + self.filtered.ids))

    @property
    def dlq_twice(self) -> dict[str, int]:
        """Ids dead-lettered from more than one record (not one record told twice)."""
        return {tid: n for tid, n in self.dlq.copies().items() if n > 1}

    @property
    def raw_twice(self) -> dict[str, int]:
        """Ids in ``rollouts.raw`` more than once: a producer sent a sample again."""
        return {} if self.raw is None else _twice(self.raw.ids)

    @property
    def scored_twice(self) -> dict[str, int]:
        """Ids in ``rollouts.scored`` more than once, trained or still in flight: the stream
        emitted a group again (the trainer would train it twice)."""
        return {} if self.scored is None else _twice(self.scored.ids)

    @property
    def unknown_dead_letters(self) -> set[str]:
        """Dead-lettered ids no producer ledger knows (not a loss; worth a look)."""
        known = self.delivered | self.produced.orphaned_ids | self.produced.dead_lettered_ids
        return set(self.dlq.ids) - known

    @property
    def unprocessed(self) -> set[str]:
        """In flight in the stream: in raw without an outcome, and either past what the
        stream's table has applied or in a group it is still assembling (needs the raw and
        scored views)."""
        if self.raw is None or self.scored is None or self.progress is None:
            return set()
        return self._waiting_in_stream() - self.lost_in_flight

    @property
    def untrained(self) -> set[str]:
        """In flight in the trainer: scored past the trainer's committed offsets, not yet
        trained, filtered or dead-lettered."""
        if self.scored is None or self.progress is None:
            return set()
        return self._waiting_in_trainer() - self.lost_in_flight

    @property
    def lost_in_flight(self) -> set[str]:
        """Ids the progress views would call in flight that are not: behind a later record
        of their partition that already has an outcome. The trainer reads a partition in
        order, so a scored group past its committed offset with a later group of its
        partition in the ledger was read and passed over; the stream applies a partition in
        order and commits its outputs with its table's watermark, so a raw record past that
        watermark (not in an open group) with a later record of its partition scored or
        set aside was skipped. Without this, a wrong or stale view of progress (a wrong
        group id, a table that was not found) would hide any loss as in flight."""
        if self.raw is None or self.scored is None or self.progress is None:
            return set()
        lost = set()
        trained_front = _front(self.scored.positions, set(self.trained))
        for tid in self._waiting_in_trainer():
            partition, offset = self.scored.positions[tid]
            if offset < trained_front.get(partition, -1):
                lost.add(tid)
        decided_front = _front(self.raw.positions, set(self.scored.ids) | self.accounted)
        for tid in self._waiting_in_stream():
            partition, offset = self.raw.positions[tid]
            if tid not in self.progress.open_group_ids and offset < decided_front.get(
                partition, -1
            ):
                lost.add(tid)
        return lost

    def _waiting_in_stream(self) -> set[str]:
        assert self.raw is not None and self.scored is not None and self.progress is not None
        waiting = set(self.raw.ids) - set(self.scored.ids) - self.accounted
        positions, progress = self.raw.positions, self.progress
        return {tid for tid in waiting if progress.in_stream(positions[tid], tid)}

    def _waiting_in_trainer(self) -> set[str]:
        assert self.scored is not None and self.progress is not None
        waiting = set(self.scored.ids) - self.accounted
        positions, progress = self.scored.positions, self.progress
        return {tid for tid in waiting if progress.in_trainer(positions[tid])}

    def dlq_reasons(self) -> Counter[str]:
        return self.dlq.reason_counts()

    def problems(self) -> list[str]:
        """Violations of exactly-once accounting; empty when the run reconciles."""
        out = []
        for name, ids in (
            ("delivered but neither trained, stale, dead-lettered nor filtered", self.missing),
            ("trained more than once", set(self.trained_twice)),
            ("trained but never produced", self.unproduced),
            ("trained and also filtered as stale", self.trained_and_stale),
            ("trained and also filtered by a data operator", self.trained_and_filtered),
            ("trained and also dead-lettered", self.trained_and_dead_lettered),
            ("dead-lettered and also stale or filtered", self.dead_lettered_and_set_aside),
            ("dead-lettered from more than one record", set(self.dlq_twice)),
            ("in the raw topic more than once", set(self.raw_twice)),
            ("in the scored topic more than once", set(self.scored_twice)),
            ("refused by the trainer as already trained (scored twice)", set(self.refused)),
            ("in flight behind a later record that has an outcome (lost)", self.lost_in_flight),
        ):
            if ids:
                out.append(f"{len(ids)} {name}: {_sample(ids)}")
        if self.produced.pending:
            out.append(f"{len(self.produced.pending)} producer group(s) still pending")
        return out + self.rollback_problems

    def counts(self) -> dict[str, Any]:
        """Figures for a log line or ``--json``."""
        trained = set(self.trained)
        stale, dlq = set(self.stale.ids), set(self.dlq.ids)
        data: dict[str, Any] = {
            "run_id": self.run_id,
            "delivery_from": self.delivery,
            "producers": self.produced.producers,
            "delivered_groups": len(self.produced.delivered),
            "delivered": len(self.delivered),
            "orphaned": len(self.produced.orphaned_ids),
            "lost_groups": len(self.produced.lost),
            "dead_lettered_by_producers": len(self.produced.dead_lettered_ids),
            "trained": len(trained),
            "trained_total": sum(self.trained.values()),
            "trained_of_delivered": len(trained & self.delivered),
            "trained_of_orphaned": len(trained & self.produced.orphaned_ids),
            "stale": len(stale),
            "stale_of_delivered": len(stale & self.delivered),
            "dlq": len(dlq),
            "dlq_of_delivered": len(dlq & self.delivered),
            "dlq_reasons": dict(self.dlq_reasons()),
            "filtered": len(self.filtered.ids),
            "filtered_reasons": dict(self.filtered.reason_counts()),
            "missing": len(self.missing),
            "trained_twice": len(self.trained_twice),
            "unproduced": len(self.unproduced),
            "unknown_dead_letters": len(self.unknown_dead_letters),
            "trained_and_dead_lettered": len(self.trained_and_dead_lettered),
            "dead_lettered_and_set_aside": len(self.dead_lettered_and_set_aside),
            "dlq_twice": len(self.dlq_twice),
            "refused_by_trainer": len(self.refused),
            "trained_then_rolled_back": len(self.rolled_back),
        }
        if self.scored is not None:
            data["scored"] = len(self.scored.ids)
            data["scored_twice"] = len(self.scored_twice)
            data["untrained"] = len(self.untrained)
        if self.raw is not None:
            data["raw"] = len(self.raw.ids)
            data["raw_twice"] = len(self.raw_twice)
            data["unprocessed"] = len(self.unprocessed)
        if self.raw is not None and self.scored is not None and self.progress is not None:
            data["lost_in_flight"] = len(self.lost_in_flight)
        return data


def _twice(ids: Counter[str]) -> dict[str, int]:
    return {tid: n for tid, n in ids.items() if n > 1}


def _front(positions: Mapping[str, tuple[int, int]], ids: set[str]) -> dict[int, int]:
    """The highest offset per partition that any of ``ids`` holds."""
    front: dict[int, int] = {}
    for tid in ids:
        if tid in positions:
            partition, offset = positions[tid]
            front[partition] = max(front.get(partition, -1), offset)
    return front


def _sample(ids: Iterable[str], n: int = 5) -> str:
    ordered = sorted(ids)
    return ", ".join(ordered[:n]) + (f", ... ({len(ordered) - n} more)" if len(ordered) > n else "")


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


def audit(
    sources: AuditSources,
    *,
    diagnose: bool = True,
    timeout_s: float = 60.0,
    delivery: Delivery = "auto",
) -> AuditReport:
    """Read the ledgers and topics of one run and reconcile them. ``diagnose`` also reads
    raw and scored (needed to settle pending producer groups and to list what is still in
    flight). ``delivery``: what the producers delivered comes from their ledger files, or
    from the raw topic (``produced_from_raw``: producers on other machines); ``auto`` uses
    the ledgers when ``producers_dir`` holds any."""
    client, run = sources.client_config, sources.run_id
    if delivery == "auto":
        has_ledgers = any(Path(sources.producers_dir).glob("*/ledger.jsonl"))
        delivery = "ledgers" if has_ledgers else "topic"
    raw_view = None
    if delivery == "topic":
        raw_view = read_ids(client, sources.raw, run, timeout_s, groups=True)
        produced = produced_from_raw(raw_view)
    else:
        produced = read_producer_ledgers(sources.producers_dir)
    trained = read_trainer_ledger(sources.trainer_ledger)
    rolled_back, rollback_problems = read_trainer_rolled_back(sources.trainer_ledger)
    report = AuditReport(
        run_id=run,
        produced=produced,
        trained=trained,
        refused=read_trainer_refused(sources.trainer_ledger),
        rolled_back=rolled_back,
        rollback_problems=rollback_problems,
        stale=read_sinks(client, sources.stales, run, timeout_s),
        dlq=read_sinks(client, sources.dlqs, run, timeout_s),
        delivery=delivery,
    )
    if sources.filtered is not None:
        report.filtered = read_sinks(client, (sources.filtered,), run, timeout_s)
    if diagnose or produced.pending:
        report.progress = read_progress(
            client,
            sources.stream_app_id,
            sources.raw,
            sources.trainer_group,
            sources.scored,
            timeout_s,
        )
        report.raw = raw_view or read_ids(client, sources.raw, run, timeout_s)
        report.scored = read_ids(client, sources.scored, run, timeout_s)
        produced.settle_pending(report.raw.ids)
    return report


@click.command("audit")
@click.option(
    "--ledger",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Trainer ledger (default: trainer.ledger_file, else ledger.jsonl in the trainer's "
    "checkpoint directory).",
)
@click.option(
    "--producers-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the producer ledgers (default: <state_dir>/producers/<run_id>).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Skip reading raw, scored and the stream's table: records in flight count as missing.",
)
@click.option(
    "--delivery",
    type=click.Choice(["auto", "ledgers", "topic"]),
    default="auto",
    show_default=True,
    help="What the producers delivered: their ledger files (--producers-dir), or the raw "
    "topic itself (producers on other machines); auto: the ledgers if any are found.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, help="Read timeout (s).")
@click.pass_obj
def audit_command(
    config: RollstreamConfig,
    ledger: Path | None,
    producers_dir: Path | None,
    quick: bool,
    delivery: Delivery,
    as_json: bool,
    timeout_s: float,
) -> None:
    """Reconcile the producers' delivery ledgers with the trainer's ledger and the stale,
    filtered and dead-letter topics of one run. Records still in flight (not yet applied by
    the stream, in a group it is assembling, or scored past the trainer's committed
    offsets) are listed as unprocessed / untrained, not as missing. Exit 1 on any
    discrepancy."""
    from dataclasses import replace

    from infra.services import Services

    if config.policies and not config.policy and (ledger or producers_dir):
        raise click.UsageError(
            "--ledger and --producers-dir are one policy's files: name it with --policy"
        )
    resolved = Services(config).running(s3=False)
    views = (
        {name: resolved.view(name) for name in sorted(resolved.policies)}
        if resolved.policies and not resolved.policy
        else {resolved.policy: resolved}
    )  # a multi-policy run is audited policy by policy: each has its own topics and ledgers
    figures: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for name, view in views.items():
        if ledger is not None:
            trainer = view.trainer.model_copy(update={"ledger_file": ledger})
            view = view.model_copy(update={"trainer": trainer})
        sources = AuditSources.from_config(view)
        if not sources.trainer_ledger.is_file():  # else every trained id would look missing
            raise click.UsageError(
                f"no trainer ledger at {sources.trainer_ledger} (the trainer writes it once "
                "its first checkpoint is durable): audit with the trainer's config on its "
                "machine, or pass --ledger"
            )
        if producers_dir is not None:
            sources = replace(sources, producers_dir=producers_dir)
        report = audit(sources, diagnose=not quick, timeout_s=timeout_s, delivery=delivery)
        found = report.problems()
        figures[name] = {**report.counts(), "problems": found}
        problems += [f"policy {name}: {line}" if name else line for line in found]
    if as_json:
        single = len(views) == 1  # one policy's figures, as for a single-policy run
        click.echo(json.dumps(next(iter(figures.values())) if single else figures, indent=2))
    else:
        for name, counts in figures.items():
            if len(views) > 1:
                click.echo(f"policy {name}")
            for key, value in counts.items():
                if key != "problems":
                    click.echo(f"{key:<22} {value}")
        for line in problems:
            click.echo(f"PROBLEM: {line}")
        if not problems:
            click.echo("reconciled: every delivered trajectory trained once, stale or in the DLQ")
    if problems:
        sys.exit(1)
