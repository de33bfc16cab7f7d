"""A trainer whose stderr is a file (a role started by hand, ``up``'s log files) shows its
progress as whole log lines, reward included, not as a bar cut to 80 columns."""

from __future__ import annotations

import logging

import pytest

from consumers.metrics import MetricsSink


def test_progress_goes_to_the_log_when_stderr_is_not_a_terminal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = MetricsSink(None, progress=True, total_steps=100)  # pytest's stderr is no terminal
    try:
        with caplog.at_level(logging.INFO, logger="consumers.metrics"):
            sink.emit({"step": 7.0, "version": 6.0, "reward/mean": 0.625, "staleness/mean": 1.5})
    finally:
        sink.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "consumers.metrics"]
    assert lines == ["train step 7/100  v 6  reward 0.625  stale 1.50"]
