"""``rollstream export-dataset`` without a broker: which scored samples become rows, what a
row holds (a multi-turn one included), the dataset on disk as ``datasets`` loads it, and
garbage refused. The export of a real run is asserted in test_e2e_pipeline."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from support.synthetic import scored_group, synthetic_groups

from consumers.checkpoint import TrainingLedger
from core.models import TinyTokenizer
from rollstream.cli.main import main
from rollstream.runs.dataset import (
    PROVENANCE_NAME,
    DatasetCounts,
    DatasetFilter,
    dataset_rows,
    trained_steps,
    write_dataset,
)
from rollstream.runs.export import ExportError, staged_directory
from schemas.trajectory import TurnKind


def _groups(version: int = 3, rewards: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)):
    groups = synthetic_groups(2, version=version, seed=4)
    groups = [
        [dataclasses.replace(t, reward=r) for t, r in zip(g, rewards, strict=True)] for g in groups
    ]
    return [scored_group(g) for g in groups]


def _export(groups, steps, keep=None, tokenizer=None):
    counts = DatasetCounts()
    rows = list(dataset_rows(groups, steps, keep or DatasetFilter(), tokenizer, counts))
    return rows, counts


def test_only_trained_samples_by_default_each_with_its_step_and_staleness() -> None:
    first, second = _groups(version=3)
    ledger = [(5, [t.trajectory_id for t in first.samples])]
    rows, counts = _export([first, second], trained_steps(ledger))
    assert [r["trajectory_id"] for r in rows] == [t.trajectory_id for t in first.samples]
    assert {r["step"] for r in rows} == {5}
    assert {r["staleness"] for r in rows} == {1}  # trained at v4, generated at v3
    assert (counts.samples, counts.filtered, counts.rows) == (8, 4, 4)
    assert counts.trained_not_found == set()

    rows, counts = _export([first, second], trained_steps(ledger), DatasetFilter(True))
    assert len(rows) == 8
    assert [r["step"] for r in rows[4:]] == [None] * 4
    assert [r["staleness"] for r in rows[4:]] == [None] * 4


def test_reward_and_staleness_filters() -> None:
    first, second = _groups(version=3)
    steps = trained_steps(
        [
            (4, [t.trajectory_id for t in first.samples]),
            (7, [t.trajectory_id for t in second.samples]),
        ]
    )
    rows, _ = _export([first, second], steps, DatasetFilter(min_reward=0.5))
    assert sorted(r["reward"] for r in rows) == [0.5, 0.5, 1.0, 1.0]
    rows, _ = _export([first, second], steps, DatasetFilter(max_staleness=0))
    assert {r["step"] for r in rows} == {4}  # 4 - 1 - 3 = 0; the second group is 3 behind
    # an untrained sample has no staleness: a staleness bound leaves it out
    rows, _ = _export([first, second], {}, DatasetFilter(True, max_staleness=10))
    assert rows == []
    # a NaN reward passes no reward bound
    nan = scored_group([dataclasses.replace(t, reward=math.nan) for t in first.samples])
    rows, _ = _export([nan], {}, DatasetFilter(True, min_reward=-1e9))
    assert rows == []


def test_a_multi_turn_sample_becomes_messages_and_a_policy_token_mask() -> None:
    base = synthetic_groups(1, group_size=1, response_len=6, vary_lengths=False, seed=2)[0][0]
    traj = dataclasses.replace(
        base,
        turn_kinds=np.array([TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY], dtype=np.int8),
        turn_lengths=np.array([2, 3, 1], dtype=np.int32),
        tool_calls=1,
        reward_details={"digits": 2},
    )
    tokenizer = TinyTokenizer()
    rows, _ = _export([scored_group([traj])], {traj.trajectory_id: 1}, tokenizer=tokenizer)
    (row,) = rows
    response = traj.response_ids
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert row["messages"][0]["content"] == tokenizer.decode(list(traj.prompt_ids))
    assert row["messages"][2]["content"] == tokenizer.decode(list(response[2:5]))
    assert row["completion"] == tokenizer.decode(list(response))
    assert row["completion_ids"] == response.tolist()
    assert row["completion_mask"] == [1, 1, 0, 0, 0, 1]
    assert json.loads(row["reward_details"]) == {"digits": 2}


def test_malformed_and_repeated_samples_are_counted_not_exported() -> None:
    (first, _) = _groups()
    broken = first.samples[0]
    # turns that do not cover the response (a record the stream should have refused)
    object.__setattr__(broken, "turn_kinds", np.array([TurnKind.POLICY], dtype=np.int8))
    object.__setattr__(broken, "turn_lengths", np.array([0], dtype=np.int32))
    steps = {t.trajectory_id: 1 for t in first.samples}
    rows, counts = _export([first, first], steps)
    assert len(rows) == 3
    assert (counts.malformed, counts.duplicates, counts.rows) == (1, 4, 3)


def test_the_dataset_loads_with_datasets_and_a_used_directory_is_refused(tmp_path: Path) -> None:
    from datasets import load_from_disk

    first, second = _groups()
    rows, _ = _export([first, second], {}, DatasetFilter(True), TinyTokenizer())
    out = tmp_path / "data"
    write_dataset(rows, out, {"run_id": "test"})
    loaded = load_from_disk(str(out))
    assert len(loaded) == 8
    assert loaded[0]["completion_ids"] == rows[0]["completion_ids"]
    assert loaded[7]["step"] is None
    assert json.loads((out / PROVENANCE_NAME).read_text()) == {"run_id": "test"}
    with pytest.raises(ExportError, match="not an empty directory"):
        write_dataset(rows, out, {})
    assert len(load_from_disk(str(out))) == 8  # the first export is untouched


def test_a_failed_export_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "data"
    with pytest.raises(RuntimeError), staged_directory(out) as staging:
        (staging / "part").write_text("half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_a_torn_ledger_line_is_ignored(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_bytes(
        b'{"step": 1, "trajectory_ids": ["a", "b"]}\n{"step": 2, "trajectory_ids": ["c"'
    )
    assert trained_steps(TrainingLedger.read(ledger)) == {"a": 1, "b": 1}


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--max-staleness", "-1"], 2, "-1 is not in the range x>=0"),
        (["--min-reward", "high"], 2, "'high' is not a valid float"),
        (["--min-reward", "nan"], 2, "must be a finite number"),
        ([], 1, "no trainer ledger at"),
    ],
)
def test_garbage_options_are_refused_before_anything_is_read(
    tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    env = {"ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"}  # never reached
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        ["--state-dir", str(tmp_path), "export-dataset", "--out", str(out), *args],
        env=env,
    )
    assert result.exit_code == code, result.output
    assert message in result.output
    assert not out.exists()
