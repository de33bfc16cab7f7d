"""The audit's reconciliation logic on ledgers written by the roles' own writers (no Kafka:
the topic views are built by hand; ``tests/system/rollstream/test_chaos.py`` reads real topics)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from consumers.checkpoint import TrainingLedger
from producers.rollout.ledger import Ledger
from rollstream.runs.audit import AuditReport
from rollstream.runs.reads import (
    Progress,
    TopicView,
    read_producer_ledgers,
    read_trainer_ledger,
    read_trainer_refused,
)


def _ids(group: str, n: int = 2) -> list[str]:
    return [f"{group}-{i}" for i in range(n)]


def _producer_ledgers(root: Path) -> None:
    with Ledger(root / "p0", fsync=False) as ledger:
        for group in ("a", "b", "c"):
            ledger.pending(group, _ids(group))
            ledger.delivered(group, _ids(group), [(0, 0), (0, 1)])
        ledger.pending("d", _ids("d"))  # killed before its acknowledgements
        ledger.pending("e", _ids("e"))
        ledger.orphaned("e", ["e-0"], [(0, 9)])
    with Ledger(root / "p1", fsync=False) as ledger:
        ledger.pending("f", _ids("f"))
        ledger.delivered("f", _ids("f"), [(1, 0), (1, 1)])


def _view(topic: str, ids: list[str], reason: str | None = None) -> TopicView:
    view = TopicView(topic, Counter(ids))
    if reason is not None:
        view.reasons = dict.fromkeys(ids, reason)
    return view


def test_ledgers_fold_and_pending_groups_settle_against_raw(tmp_path: Path) -> None:
    _producer_ledgers(tmp_path)
    produced = read_producer_ledgers(tmp_path)
    assert produced.producers == 2
    assert set(produced.delivered) == {"a", "b", "c", "f"}
    assert produced.orphaned_ids == {"e-0"}
    assert set(produced.pending) == {"d"}
    assert produced.settle_pending(["d-0", "d-1", "a-0"]) == 1
    assert "d" in produced.delivered and not produced.pending


def test_report_reconciles_and_names_each_violation(tmp_path: Path) -> None:
    _producer_ledgers(tmp_path)
    produced = read_producer_ledgers(tmp_path)
    produced.settle_pending([])  # d: none of it reached raw, lost
    ledger = TrainingLedger(tmp_path / "trainer.jsonl", fsync=False)
    ledger.append([(1, [*_ids("a"), "e-0"]), (2, _ids("b"))])
    trained = read_trainer_ledger(tmp_path / "trainer.jsonl")
    report = AuditReport(
        run_id="r",
        produced=produced,
        trained=trained,
        stale=_view("stale", ["c-0"], "stale:3"),
        dlq=_view("dlq", ["c-1", *_ids("f")], "incomplete_group"),
    )
    assert report.problems() == []
    assert produced.lost == {"d"}
    counts = report.counts()
    assert counts["delivered"] == 8 and counts["trained_of_orphaned"] == 1
    assert counts["dlq_reasons"] == {"incomplete_group": 3}

    ledger.append([(3, ["a-1", "zz-0"])])  # a-1 trained again, zz-0 never produced
    report.trained = read_trainer_ledger(tmp_path / "trainer.jsonl")
    report.dlq = _view("dlq", ["c-1"], "incomplete_group")  # f-* now without an outcome
    problems = report.problems()
    assert report.missing == {"f-0", "f-1"}
    assert report.trained_twice == {"a-1": 2}
    assert report.unproduced == {"zz-0"}
    assert len(problems) == 3 and "f-0" in problems[0]


def _positioned(topic: str, positions: dict[str, tuple[int, int]]) -> TopicView:
    view = TopicView(topic, Counter(list(positions)))
    view.positions = dict(positions)
    return view


def test_records_in_flight_are_told_from_lost_ones(tmp_path: Path) -> None:
    """After a run stops, a record the stream has not applied yet, one in a group it is
    still assembling, and a scored group past the trainer's committed offset are in flight;
    a record the stream applied without any outcome, or a scored group below the trainer's
    committed offset that was never trained, is lost."""
    with Ledger(tmp_path / "p0", fsync=False) as ledger:
        for group in ("t", "u", "v", "w", "x", "y"):
            ledger.pending(group, _ids(group, 1))
            ledger.delivered(group, _ids(group, 1), [(0, 0)])
    produced = read_producer_ledgers(tmp_path)
    ledger = TrainingLedger(tmp_path / "trainer.jsonl", fsync=False)
    ledger.append([(1, ["t-0"])])
    raw = _positioned(
        "raw",
        {"t-0": (0, 1), "u-0": (0, 2), "v-0": (0, 3), "w-0": (0, 9), "x-0": (1, 4), "y-0": (0, 5)},
    )
    scored = _positioned("scored", {"t-0": (0, 0), "u-0": (0, 1), "v-0": (0, 2)})
    report = AuditReport(
        run_id="r",
        produced=produced,
        trained=read_trainer_ledger(tmp_path / "trainer.jsonl"),
        stale=_view("stale", []),
        dlq=_view("dlq", []),
        scored=scored,
        raw=raw,
        progress=Progress(
            stream_applied={0: 5, 1: 4},  # w-0 at raw offset 9 not applied yet
            open_group_ids={"x-0"},  # applied, waiting for its group's other samples
            trainer_committed={0: 2},  # scored offsets 0 and 1 are behind the trainer
        ),
    )
    assert report.untrained == {"v-0"}
    assert report.unprocessed == {"w-0", "x-0"}
    assert report.missing == {"u-0", "y-0"}  # scored and skipped; applied without an outcome
    assert len(report.problems()) == 1 and "u-0" in report.problems()[0]
    assert report.counts()["untrained"] == 1 and report.counts()["unprocessed"] == 2


def test_delivery_told_by_the_raw_topic_when_producers_ran_elsewhere() -> None:
    """Without ledger files, a group whose G samples are all in raw was delivered, one with
    fewer was left partly by a crash (orphaned)."""
    from rollstream.runs.reads import produced_from_raw

    raw = TopicView("raw")
    raw.groups = {"a": {"a-0", "a-1"}, "b": {"b-1"}}
    raw.group_sizes = {"a": 2, "b": 2}
    raw.producers = {"home-0", "eu-0"}
    produced = produced_from_raw(raw)
    assert produced.producers == 2
    assert produced.delivered == {"a": ["a-0", "a-1"]}
    assert produced.orphaned == {"b": ["b-1"]}
    assert not produced.pending and not produced.lost


def test_samples_a_data_operator_filtered_are_accounted_once(tmp_path: Path) -> None:
    _producer_ledgers(tmp_path)
    produced = read_producer_ledgers(tmp_path)
    produced.settle_pending([])
    ledger = TrainingLedger(tmp_path / "trainer.jsonl", fsync=False)
    ledger.append([(1, [*_ids("a"), "e-0"])])
    report = AuditReport(
        run_id="r",
        produced=produced,
        trained=read_trainer_ledger(tmp_path / "trainer.jsonl"),
        stale=_view("stale", ["c-0"], "stale:3"),
        dlq=_view("dlq", ["c-1"], "incomplete_group"),
    )
    assert report.missing == {"b-0", "b-1", "f-0", "f-1"}  # no filtered view yet
    report.filtered = _view("filtered", [*_ids("b"), *_ids("f")], "zero_variance:zero_variance")
    assert report.problems() == []
    counts = report.counts()
    assert counts["filtered"] == 4
    assert counts["filtered_reasons"] == {"zero_variance:zero_variance": 4}
    report.filtered = _view("filtered", [*_ids("b"), *_ids("f"), "a-0"], "x:y")  # and trained
    assert report.trained_and_filtered == {"a-0"}
    assert any("filtered by a data operator" in p for p in report.problems())


def _settled(tmp_path: Path, groups: str) -> AuditReport:
    """A report over one producer that delivered one-sample groups ``groups`` (ids
    ``<g>-0``), nothing trained and no outcome yet: each test adds what it needs."""
    with Ledger(tmp_path / "p0", fsync=False) as ledger:
        for group in groups:
            ledger.pending(group, _ids(group, 1))
            ledger.delivered(group, _ids(group, 1), [(0, 0)])
    return AuditReport(
        run_id="r",
        produced=read_producer_ledgers(tmp_path),
        trained=Counter(),
        stale=_view("stale", []),
        dlq=_view("dlq", []),
    )


def _dead_letters(letters: dict[str, list[tuple[str, int, int]]], reason: str) -> TopicView:
    """A DLQ view: each id with the source records (topic, partition, offset) of its letters."""
    view = TopicView("dlq")
    for tid, sources in letters.items():
        view.ids[tid] += len(sources)
        view.reasons[tid] = reason
        view.origins[tid] = Counter(sources)
    return view


def _problem(report: AuditReport, name: str) -> str:
    found = [p for p in report.problems() if name in p]
    assert len(found) == 1, report.problems()
    return found[0]


def test_a_trajectory_trained_and_also_dead_lettered_is_a_problem(tmp_path: Path) -> None:
    """A producer's re-send the stream dead-letters (``duplicate_sample``) while the first
    copy trains: each id has an outcome, so ``missing`` cannot see it."""
    report = _settled(tmp_path, "ab")
    report.trained = Counter({"a-0": 1, "b-0": 1})
    report.dlq = _dead_letters({"a-0": [("raw", 0, 7)]}, "duplicate_sample")
    assert report.trained_and_dead_lettered == {"a-0"}
    assert "a-0" in _problem(report, "trained and also dead-lettered")
    assert report.counts()["trained_and_dead_lettered"] == 1


def test_a_trajectory_dead_lettered_and_also_set_aside_is_a_problem(tmp_path: Path) -> None:
    report = _settled(tmp_path, "ab")
    report.dlq = _dead_letters({"a-0": [("raw", 0, 3)], "b-0": [("raw", 0, 4)]}, "late_sample")
    report.stale = _view("stale", ["a-0"], "stale:5")
    report.filtered = _view("filtered", ["b-0"], "x:y")
    assert report.dead_lettered_and_set_aside == {"a-0", "b-0"}
    assert "2 dead-lettered and also stale or filtered" in _problem(report, "dead-lettered and")
    assert report.counts()["dead_lettered_and_set_aside"] == 2


def test_a_record_twice_in_raw_is_a_problem(tmp_path: Path) -> None:
    report = _settled(tmp_path, "ab")
    report.trained = Counter({"a-0": 1, "b-0": 1})
    report.raw = TopicView("raw", Counter({"a-0": 2, "b-0": 1}))
    report.scored = TopicView("scored", Counter({"a-0": 1, "b-0": 1}))
    report.progress = Progress(stream_applied={0: 9})
    assert report.raw_twice == {"a-0": 2}
    assert "a-0" in _problem(report, "in the raw topic more than once")
    assert report.counts()["raw_twice"] == 1


def test_a_group_twice_in_scored_is_a_problem_even_while_in_flight(tmp_path: Path) -> None:
    """The second copy waits past the trainer's committed offset: in flight, yet a
    duplicate the trainer would train again."""
    report = _settled(tmp_path, "ab")
    report.trained = Counter({"a-0": 1})
    report.raw = _positioned("raw", {"a-0": (0, 0), "b-0": (0, 1)})
    report.scored = _positioned("scored", {"a-0": (0, 5), "b-0": (0, 6)})
    report.scored.ids["b-0"] += 1
    report.progress = Progress(stream_applied={0: 1}, trainer_committed={0: 3})
    assert report.untrained == {"b-0"} and report.missing == set()
    assert report.scored_twice == {"b-0": 2}
    assert "b-0" in _problem(report, "in the scored topic more than once")
    assert report.counts()["scored_twice"] == 1


def test_a_trajectory_dead_lettered_from_two_records_is_a_problem(tmp_path: Path) -> None:
    """Two letters of one source record are one decision told twice (a trainer dead-letters
    again what it re-reads after a crash); letters of two records are a duplicate."""
    report = _settled(tmp_path, "ab")
    report.dlq = _dead_letters(
        {"a-0": [("raw", 0, 3), ("raw", 0, 8)], "b-0": [("scored", 1, 4), ("scored", 1, 4)]},
        "late_sample",
    )
    assert report.dlq_twice == {"a-0": 2}
    problem = _problem(report, "dead-lettered from more than one record")
    assert "a-0" in problem and "b-0" not in problem
    assert report.counts()["dlq_twice"] == 1
    assert report.counts()["dlq"] == 2


def test_a_record_skipped_behind_what_was_trained_or_applied_is_lost(tmp_path: Path) -> None:
    """In flight means not reached yet. A scored group past the trainer's committed offset
    while a later group of its partition is in the trainer's ledger was read and passed
    over (the trainer reads a partition in order); a raw record past the stream's applied
    watermark while a later record of its partition already has an outcome was skipped
    (the stream applies a partition in order and commits outputs with its watermark).
    Either is lost, not in flight: a wrong or stale view of progress would otherwise hide
    any loss."""
    report = _settled(tmp_path, "abcdef")
    report.trained = Counter({"b-0": 1})
    report.raw = _positioned(
        "raw",
        {"a-0": (0, 0), "b-0": (0, 1), "c-0": (1, 0), "d-0": (1, 1), "e-0": (2, 0), "f-0": (2, 1)},
    )
    report.scored = _positioned("scored", {"a-0": (0, 4), "b-0": (0, 5), "d-0": (1, 0)})
    # the trainer group committed nothing (partition 0: a wrong group?), the table watermark
    # of raw partition 1 is behind d-0 which the stream did score; partition 2 is untouched
    report.progress = Progress(stream_applied={}, trainer_committed={1: 0})
    assert report.lost_in_flight == {"a-0", "c-0"}
    assert report.untrained == {"d-0"} and report.unprocessed == {"e-0", "f-0"}
    assert "a-0" in _problem(report, "in flight behind a later record")
    assert report.counts()["lost_in_flight"] == 2


def test_a_group_the_trainer_refused_as_already_trained_is_a_problem(tmp_path: Path) -> None:
    """Trained once, yet read again: the trainer refused the copy and its ledger says so;
    the stream emitted the group twice, which the audit names."""
    report = _settled(tmp_path, "ab")
    ledger = TrainingLedger(tmp_path / "trainer.jsonl", fsync=False)
    ledger.append([(1, ["a-0"]), (2, ["b-0"])], refused=[(2, ["a-0"])])
    report.trained = read_trainer_ledger(ledger.path)
    report.refused = read_trainer_refused(ledger.path)
    assert report.trained == Counter({"a-0": 1, "b-0": 1}) and report.missing == set()
    assert "a-0" in _problem(report, "refused by the trainer as already trained")
    assert report.counts()["refused_by_trainer"] == 1
