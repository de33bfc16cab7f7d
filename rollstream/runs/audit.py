"""``rollstream audit``: reconcile what the producers delivered with what became of it.

Why: the pipeline promises that every trajectory a producer delivered is either trained
exactly once, filtered as stale, dead-lettered with a reason, or filtered out by a data
operator (``rollouts.filtered``, ``rs-filtered`` header), and that nothing is
trained that no producer produced. Each role keeps its own record of its side:

- the producers' delivery ledgers (``producers.rollout.ledger``, one per producer under
  ``<state_dir>/producers/<run_id>/``): trajectory ids of every group whose G records
  Kafka acknowledged (*delivered*), and of groups a crash left partly in the topic
  (*orphaned*; the stream closes them as partial groups or dead-letters them), and gateway
  episodes a stopping producer dead-lettered itself (*dead-lettered by producers*, expected
  in the DLQ like delivered ids, never in raw), and gateway episodes abandoned without a
  reward, with their committed calls and reasons (a producer killed mid-episode abandons
  its open ones when it restarts: never published, so counted apart, never as lost). Producers
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

import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from rollstream.config.settings import RollstreamConfig
from rollstream.runs.reads import (
    AuditSources,
    Delivery,
    Produced,
    Progress,
    TopicView,
    produced_from_raw,
    read_ids,
    read_producer_ledgers,
    read_progress,
    read_sinks,
    read_trainer_ledger,
    read_trainer_refused,
    read_trainer_rolled_back,
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

    def _episode_counts(self) -> dict[str, Any]:
        """Gateway episodes that ended without a reward (never published, so never a loss),
        those of them with committed calls, and why; ``interrupted``: episodes with calls
        whose producer was killed and not restarted (its restart abandons them)."""
        produced = self.produced
        abandoned = produced.abandoned
        with_calls = {eid: why for eid, why in abandoned.items() if eid in produced.episode_calls}
        return {
            "abandoned_episodes": len(abandoned),
            "abandoned_with_calls": len(with_calls),
            "abandoned_reasons": dict(Counter(abandoned.values())),
            "interrupted_episodes": len(produced.interrupted),
        }

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
            **self._episode_counts(),
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
