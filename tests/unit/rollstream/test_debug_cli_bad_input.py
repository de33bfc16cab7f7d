"""Garbage given to the debugging commands gets a clear error naming what is wrong, before
anything is read (no broker is needed: these fail while parsing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rollstream.cli.main import main


def _run(tmp_path: Path, *args: str):
    env = {"ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"}  # never reached
    return CliRunner().invoke(main, ["--state-dir", str(tmp_path), *args], env=env)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "raw", "--offset", "three:12"], "expected PARTITION:OFFSET, got 'three:12'"),
        (["replay", "raw", "--offset", "3"], "expected PARTITION:OFFSET, got '3'"),
        (["replay", "raw", "--from-time", "last tuesday"], "expected ISO 8601 or epoch"),
        (["inspect", "g1", "--to-time", "2026-13-45"], "expected ISO 8601 or epoch"),
    ],
)
def test_replay_and_inspect_reject_bad_bounds(tmp_path: Path, args, message) -> None:
    result = _run(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_report_names_the_bad_line_of_a_metrics_file(tmp_path: Path) -> None:
    metrics = tmp_path / "trainer.jsonl"
    metrics.write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean":\n')
    result = _run(tmp_path, "report", "r", "--metrics", str(metrics), "--out", str(tmp_path))
    assert result.exit_code == 1
    assert f"{metrics}:2: not JSON" in result.output
    no_step = tmp_path / "no-step.jsonl"
    no_step.write_text('{"reward/mean": 0.1}\n')
    result = _run(tmp_path, "report", "r", "--metrics", str(no_step), "--out", str(tmp_path))
    assert result.exit_code == 1 and f"{no_step}:1: a metrics row needs 'step'" in result.output
