"""bench.real_model without a model run: cell names, the store and resume, the summary."""

from __future__ import annotations

import math
import sys

import pytest

from bench import real_model as rm


def rows(correct: list[float], started: float = 1000.0) -> list[dict[str, float]]:
    """Trainer metrics rows of a fake run, one step every 10 s after a 60 s start-up."""
    return [
        {
            "step": i + 1,
            "time/unix_s": started + 60 + 10 * (i + 1),
            "reward/mean": 0.1 + 0.9 * c,
            "reward/correct_frac": c,
            "clip/frac": 0.01,
            "mis/masked_frac": 0.002,
            "policy/entropy": 0.5,
            "mismatch/abs_log_d/mean": 0.03,
            "mismatch/abs_log_d/max": 0.2 + i / 100,
            "staleness/mean": 2.0,
            "staleness/hist/0": 1.0,
            "staleness/hist/2": 3.0,
        }
        for i, c in enumerate(correct)
    ]


def record(cell: rm.Cell, correct: list[float]) -> dict:
    evals = [
        {"version": 0, "eval/reward/correct_frac": 0.05, "eval/reward/mean": 0.15},
        {"version": 10, "eval/reward/correct_frac": 0.4, "eval/reward/mean": 0.45},
    ]
    return rm.cell_record(cell, rows(correct), evals, started=1000.0, wall_s=500.0)


def test_cell_names_round_trip_and_garbage_is_refused() -> None:
    grid = rm.priority()
    assert [c.name for c in grid[:4]] == [
        "exact-w4-seed0",
        "lost-w4-seed0",
        "uncorrected-w4-seed0",
        "sync-seed0",
    ]
    assert len(grid) == len({c.name for c in grid}) == 4 * 3 + 2 * 3
    assert all(rm.Cell.parse(c.name) == c for c in grid)
    for bad in ("exact", "exact-w0-seed0", "grpo-w4-seed0", "exact-w4-s0", "sync-w4-seed0",
                "exact-wx-seed0", "sync-seed-1", ""):  # fmt: skip
        with pytest.raises(ValueError, match="unknown cell"):
            rm.Cell.parse(bad)


def test_settings_pin_the_precision_window_seed_and_route() -> None:
    exact = rm.Cell.parse("exact-w4-seed1").settings()
    assert "profile.precision=bf16" in exact and "trainer.engine.grad_accum_steps=4" in exact
    assert "profile.staleness_window=4" in exact and "producers.rollout.seed=1" in exact
    lost = rm.Cell.parse("lost-w2-seed0").settings()
    assert "trainer.approx.route=current" in lost and "streams.old_logits.mode=off" in lost
    sync = rm.Cell.parse("sync-seed0").settings()
    assert "profile.sync=true" in sync and not any("staleness_window" in s for s in sync)


def test_the_store_keeps_each_cell_and_a_resumed_grid_skips_them(tmp_path) -> None:
    path = tmp_path / "cells.json"
    assert rm.load_store(path) == {"cells": {}, "task": None}
    first = rm.Cell.parse("exact-w4-seed0")
    rm.save_cell(record(first, [0.1] * 12), path)
    rm.save_task({"greedy_correct": 0.05}, path)
    rm.save_cell(record(rm.Cell.parse("sync-seed0"), [0.2] * 12), path)
    store = rm.load_store(path)
    assert sorted(store["cells"]) == ["exact-w4-seed0", "sync-seed0"]
    assert store["task"] == {"greedy_correct": 0.05}
    left = rm.pending(rm.priority(), store["cells"])
    assert left[0].name == "lost-w4-seed0" and "sync-seed0" not in {c.name for c in left}
    assert len(left) == len(rm.priority()) - 2
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a cell store"):
        rm.load_store(path)


def test_summary_maths() -> None:
    assert rm.first_reaching([0.0, math.nan, 0.4, 0.6, 0.2], 0.5) == 3
    assert rm.first_reaching([0.1] * 20, 0.5) is None
    assert rm.final_mean([0.0] * 10 + [1.0] * 10) == 1.0
    assert math.isnan(rm.final_mean([math.nan]))
    correct = [0.0] * 10 + [1.0] * 10
    summary = rm.summary(record(rm.Cell.parse("exact-w4-seed0"), correct), target=0.3)
    # held-out accuracy reaches 0.3 at version 10, published 60 + 100 s after launch
    assert summary["steps_to"] == 10 and summary["seconds_to"] == 160
    assert rm.summary(record(rm.Cell.parse("exact-w4-seed0"), correct), 0.01)["seconds_to"] == 0
    assert summary["correct"] == 1.0 and summary["reward"] == pytest.approx(1.0)
    assert (summary["eval_first"], summary["eval_last"]) == (0.05, 0.4)
    assert summary["abs_log_d_mean"] == pytest.approx(0.03)
    assert summary["abs_log_d_max"] == pytest.approx(0.39)
    assert summary["masked"] == pytest.approx(0.002) and math.isnan(summary["truncated"])


def test_the_table_gives_mean_and_sd_over_the_seeds_present_and_the_missing_cells() -> None:
    cells = {}
    for seed, level in ((0, 0.6), (1, 0.8)):
        cell = rm.Cell("exact", 4, seed)
        cells[cell.name] = record(cell, [level] * 20)
    lost = rm.Cell("lost", 4, 0)
    cells[lost.name] = record(lost, [0.1] * 20)
    lines = rm.table(cells, target=0.3)
    exact_row = next(line for line in lines if line.startswith("| exact | 4 | 2 |"))
    assert "0.70 ± 0.14" in exact_row and "10 (2/2) | 160 |" in exact_row
    assert "0.05 ± 0.00 → 0.40 ± 0.00 (10)" in exact_row
    lines = rm.table(cells, target=0.5)
    lost_row = next(line for line in lines if line.startswith("| lost | 4 | 1 |"))
    assert "- (0/1) | - |" in lost_row
    missing = rm.missing_cells(cells)
    assert missing[0] == "uncorrected-w4-seed0" and "exact-w4-seed1" not in missing
    assert rm.untrained_eval(cells) == (0.05, 0.15)
    assert rm.untrained_eval({}) is None
    hist = rm.staleness_lines(cells)
    assert "exact, window 4: 0: 25%, 2: 75%" in hist[0]


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--steps", "-3"], ["--target", "1.5"], ["--cells", "exact-w4"]],
)
def test_garbage_arguments_are_refused(monkeypatch, argv) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.real_model", *argv])
    with pytest.raises(SystemExit) as exit_info:
        rm.main()
    assert exit_info.value.code == 2


def test_without_native_bf16_the_grid_is_refused_before_any_cell_runs(monkeypatch) -> None:
    def run_cell(cell: rm.Cell, steps: int) -> dict:
        raise AssertionError(f"{cell.name} ran")

    monkeypatch.setattr(sys, "argv", ["bench.real_model", "--cells", "exact-w4-seed0"])
    monkeypatch.setattr(rm, "load_store", lambda: {"cells": {}, "task": None})
    monkeypatch.setattr(rm, "run_cell", run_cell)
    monkeypatch.setattr(rm, "bf16_is_native", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        rm.main()
    assert exit_info.value.code == rm.NO_NATIVE_BF16
    assert "AVX-512 machine or a GPU" in rm.NO_NATIVE_BF16
