"""Tracking: metric rows reach TensorBoard, W&B (offline) and MLflow (a local store),
read back with each tool's own reader; a restarted role resumes its tracked run; a
failing backend is dropped without stopping the caller; bad config is refused."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from support.tracking import mlflow_history, tensorboard_scalars

from core.config import TrackingConfig
from core.tracking import Tracker

pytestmark = pytest.mark.unit

ROWS = [
    {"step": 1, "reward/mean": 0.25, "loss/total": 1.5},
    {"step": 2, "reward/mean": 0.5, "loss/total": float("nan"), "note": "text", "ok": True},
]


def _log(tracker: Tracker, rows: list[dict]) -> None:
    for row in rows:
        tracker.log(row, int(row["step"]))


def test_every_backend_gets_the_rows_and_a_restart_resumes_the_same_run(tmp_path: Path) -> None:
    config = TrackingConfig(backends=["tensorboard", "wandb", "mlflow"], project="proj")
    tracker = Tracker.open(config, tmp_path, "run-1", "trainer")
    _log(tracker, ROWS)
    tracker.close()
    # a restarted trainer logs its last step again, then goes on
    again = Tracker.open(config, tmp_path, "run-1", "trainer")
    _log(again, [ROWS[1], {"step": 3, "reward/mean": 0.75}])
    again.close()

    home = tmp_path / "tracking" / "run-1"
    scalars = tensorboard_scalars(home / "tensorboard" / "run-1-trainer", "reward/mean")
    assert sorted(set(scalars)) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert tensorboard_scalars(home / "tensorboard" / "run-1-trainer", "loss/total") == [(1, 1.5)]

    uri = f"sqlite:///{home / 'mlflow.db'}"
    history = mlflow_history(uri, "proj", "run-1-trainer", "reward/mean")
    assert sorted(set(history)) == [(1, 0.25), (2, 0.5), (3, 0.75)]

    # W&B offline: one directory per process under one run id (`wandb sync` uploads them
    # as one run). wandb has no reader of its run files; their protobuf records hold
    # keys and JSON values as plain bytes.
    runs = sorted((home / "wandb").glob("offline-run-*-run-1-trainer"))
    assert len(runs) == 2
    records = [(run / "run-run-1-trainer.wandb").read_bytes() for run in runs]
    assert all(data.startswith(b":W&B") and b"reward/mean" in data for data in records)
    assert b"0.25" in records[0] and b"0.75" in records[1]


def test_the_directory_defaults_under_the_state_dir_and_can_be_set(tmp_path: Path) -> None:
    assert TrackingConfig().directory(tmp_path, "r") == tmp_path / "tracking" / "r"
    assert TrackingConfig(dir=tmp_path / "x").directory(tmp_path, "r") == tmp_path / "x"
    assert Tracker.open(TrackingConfig(), tmp_path, "r", "trainer")._backends == []
    assert not (tmp_path / "tracking").exists()  # nothing configured, nothing written


class _Failing:
    """A test double of a backend whose service went away after it started."""

    name = "failing"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, metrics, step) -> None:
        self.calls += 1
        raise ConnectionError("dashboard gone")

    def close(self) -> None:
        raise ConnectionError("dashboard gone")


def test_a_backend_that_fails_is_dropped_and_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failing = _Failing()
    board = Tracker.open(TrackingConfig(backends=["tensorboard"]), tmp_path, "r", "eval")
    tracker = Tracker([failing, *board._backends])
    with caplog.at_level(logging.ERROR, logger="core.tracking"):
        _log(tracker, ROWS)
        tracker.close()
    assert failing.calls == 1  # dropped after its first failure, logged once
    assert sum("failing failed" in r.getMessage() for r in caplog.records) == 1
    tags = tmp_path / "tracking" / "r" / "tensorboard" / "r-eval"
    assert tensorboard_scalars(tags, "reward/mean") == [(1, 0.25), (2, 0.5)]


def test_rows_keep_only_finite_numbers(tmp_path: Path) -> None:
    tracker = Tracker.open(TrackingConfig(backends=["mlflow"]), tmp_path, "r", "trainer")
    tracker.log({"a": 1, "b": math.inf, "c": None, "d": [1], "e": "x", "f": False}, 5)
    tracker.close()
    uri = f"sqlite:///{tmp_path / 'tracking' / 'r' / 'mlflow.db'}"
    assert mlflow_history(uri, "rollstream", "r-trainer", "a") == [(5, 1.0)]
    for key in "bcdef":
        assert mlflow_history(uri, "rollstream", "r-trainer", key) == []


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"backends": ["neptune"]}, "backends"),
        ({"backends": "tensorboard"}, "backends"),
        ({"project": ""}, "project"),
        ({"wandb_mode": "cloud"}, "wandb_mode"),
        ({"tensorboard": True}, "tensorboard"),
    ],
)
def test_bad_tracking_config_is_refused_by_name(value: dict, field: str) -> None:
    with pytest.raises(ValidationError) as error:
        TrackingConfig.model_validate(value)
    assert field in str(error.value)
