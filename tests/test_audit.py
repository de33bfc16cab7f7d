"""The audit's reconciliation logic on ledgers written by the roles' own writers (no Kafka:
the topic views are built by hand; ``tests/test_chaos.py`` reads real topics)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from consumers.checkpoint import TrainingLedger
from producers.ledger import Ledger
from rollstream.audit import (
    AuditReport,
    Progress,
    TopicView,
    read_producer_ledgers,
    read_trainer_ledger,
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
    from rollstream.audit import produced_from_raw

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
