"""The multi-policy benchmark's pure parts: seeds in the config, steps to the target, the
table and the figure, on made-up runs (no service)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from bench.multi_policy import (
    BASELINE,
    CONFIG,
    POLICIES,
    Run,
    band,
    log_errors,
    plot,
    seeded,
    steps_to,
    table,
)


def _rows(rewards: list[float], s_step: float) -> list[dict[str, float]]:
    return [
        {"step": float(i + 1), "reward/mean": r, "time/unix_s": 1000.0 + i * s_step}
        for i, r in enumerate(rewards)
    ]


def _runs(seeds: int) -> tuple[list[Run], list[Run]]:
    rising = [min(1.0, 0.05 * i) for i in range(30)]
    multi = [
        Run("propose-solve", s, 90.0, {p: _rows(rising, 2.0) for p in POLICIES}, {})
        for s in range(seeds)
    ]
    flat = [0.1] * 30
    base = [Run(BASELINE, s, 50.0, {BASELINE: _rows(flat, 0.5)}, {}) for s in range(seeds)]
    return multi, base


def test_seeded_keeps_the_policies_and_seeds_every_role() -> None:
    config = seeded(3, tomllib.loads(CONFIG.read_text()))
    assert set(config["policies"]) == set(POLICIES)
    assert config["profile"]["model"] == "tiny:seed=3"
    assert config["producers"]["engine"]["seed"] == config["producers"]["rollout"]["seed"] == 3
    assert config["trainer"]["engine"]["seed"] == 3
    assert "policies" not in seeded(0)


def test_steps_to_needs_a_full_window() -> None:
    assert steps_to([1.0] * 12) == 10  # a 1-step mean of 1.0 at step 1 does not count
    assert steps_to([0.0] * 10 + [1.0] * 10) == 15  # 5 of the last 10 steps
    assert steps_to([0.4] * 30) is None


def test_table_has_a_row_per_trainer_and_the_ratio() -> None:
    multi, base = _runs(2)
    text = table(multi, base)
    assert "| proposer | 0.23 ± 0.00 |" in text
    assert "(2/2)" in text and "not reached (0/2)" in text
    assert text.count("| 4.00x |") == 2  # 2.0 s a step against 0.5


def test_band_and_plot(tmp_path: Path) -> None:
    mean, sd = band([[0.0, 1.0, 2.0], [2.0, 3.0]])
    assert mean == [1.0, 2.0] and sd[0] > 0
    assert band([[0.5]]) == ([0.5], [0.0])
    multi, _ = _runs(2)
    plot(multi, tmp_path / "curves.png", "2 cores")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_log_errors_counts_error_lines_per_role(tmp_path: Path) -> None:
    (tmp_path / "trainer-solver.log").write_text(
        "x INFO ok\ny ERROR bad\nTraceback (...)\n[1] [ERROR] faust\n"
    )
    (tmp_path / "engine-proposer.log").write_text("all fine\n")
    assert log_errors(tmp_path) == {"trainer-solver": 3}
