"""The end-to-end benchmark's pure parts: busy time per phase from the roles' counters,
the overlap bounds, the run's config, and the pipeline cell's reading of trainer metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.e2e import (
    Phases,
    Run,
    RunSpec,
    Sample,
    busy_per_step,
    cpu_per_step,
    machine_cpu_s,
    pin_groups,
    process_cpu_s,
    report,
    tree_cpu_s,
)
from bench.learning import ROUTES, Settings
from bench.learning_pipeline import (
    cell_of_rows,
    curve_gap,
    pipeline_settings,
    staleness_histogram,
)
from core.config import to_toml
from rollstream.config.settings import load_config


def _row(step: int, **values: float) -> dict[str, float]:
    return {"step": float(step), "version": float(step - 1), "reward/mean": 0.5, **values}


def test_busy_per_step_uses_the_counters_between_warmup_and_the_last_sample() -> None:
    samples = [
        Sample(0, 0.0, 0.0),  # start-up: left out
        Sample(2, 5.0, 0.5),  # first at or past the warm-up of 2 steps
        Sample(4, 6.0, 0.7),
        Sample(6, 7.0, 0.9),
    ]
    rows = [_row(s, **{"time/step_s": 0.3}) for s in range(1, 7)]
    rows[3]["time/publish_s"] = 0.1  # step 4
    rows[5]["time/checkpoint_s"] = 0.5  # step 6
    phases = busy_per_step(samples, rows, warmup=2)
    assert phases is not None
    assert phases.generate == pytest.approx((7.0 - 5.0) / 4)
    assert phases.old_logits == pytest.approx((0.9 - 0.5) / 4)
    assert phases.train == pytest.approx((4 * 0.3 + 0.1 + 0.5) / 4)  # steps 3..6 only


def test_busy_per_step_needs_two_samples_a_step_apart() -> None:
    rows = [_row(1, **{"time/step_s": 0.3})]
    assert busy_per_step([Sample(0, 1.0, 1.0), Sample(5, 2.0, 2.0)], rows, warmup=2) is None
    assert busy_per_step([Sample(3, 1.0, 1.0), Sample(3, 2.0, 2.0)], rows, warmup=2) is None


def test_cpu_per_step_counts_each_process_over_the_samples_that_saw_it() -> None:
    samples = [
        Sample(1, 0.0, 0.0, tokens=0.0, cpu_s={"engine": 1.0}),  # before the warm-up
        Sample(2, 0.0, 0.0, tokens=100.0, cpu_s={"engine": 2.0, "trainer": 1.0}),
        Sample(4, 0.0, 0.0, tokens=300.0, cpu_s={"engine": 3.0, "trainer": 2.0}),
        Sample(6, 0.0, 0.0, tokens=500.0, records=24.0, cpu_s={"engine": 4.0, "x": 1.0}),
    ]  # the trainer ended before the last sample
    assert cpu_per_step(samples, warmup=2) == {
        "engine": 0.5,
        "trainer": 0.5,
        "tokens": 100.0,
        "records": 6.0,
        "interrupted": 0.0,
    }
    assert cpu_per_step(samples[:1], warmup=0) == {}


def test_process_and_machine_cpu_seconds_grow_with_work() -> None:
    mine, machine = process_cpu_s(os.getpid()), machine_cpu_s()
    assert mine is not None
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert process_cpu_s(os.getpid()) >= mine + 0.2  # clock ticks: 10 ms resolution
    assert machine_cpu_s() >= machine + 0.2
    assert process_cpu_s(2**22 + 1) is None  # no such process


def test_a_roles_cpu_includes_its_children() -> None:
    burn = "import time\nt = time.process_time() + 0.3\nwhile time.process_time() < t: pass"
    child = subprocess.Popen([sys.executable, "-c", burn + "\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (process_cpu_s(child.pid) or 0.0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        mine = process_cpu_s(os.getpid())
        assert mine is not None
        found = tree_cpu_s({"me": os.getpid(), "gone": 2**22 + 1})
        assert set(found) == {"me"}
        assert found["me"] >= mine + 0.3
    finally:
        child.kill()
        child.wait()


def test_overlap_bound_is_sum_over_max_and_cores_and_pinning_lower_it() -> None:
    phases = Phases(generate=0.6, old_logits=0.1, train=0.3)
    assert phases.total == pytest.approx(1.0)
    assert phases.bottleneck() == "generate"
    assert phases.overlap_bound() == pytest.approx(1.0 / 0.6)
    assert phases.bound_on_cores(2) == pytest.approx(1.0 / 0.6)  # generation still dominates
    assert phases.bound_on_cores(1) == pytest.approx(1.0)  # one core: nothing to overlap
    balanced = Phases(generate=0.4, old_logits=0.3, train=0.3)
    assert balanced.overlap_bound() == pytest.approx(2.5)
    assert balanced.bound_on_cores(2) == pytest.approx(2.0)  # the work spread over 2 cores
    assert balanced.bound_pinned(pin_groups(2)) == pytest.approx(1.0 / 0.6)  # 0.3 + 0.3
    assert Phases.median([phases, balanced, balanced]) == balanced


def test_both_modes_get_the_seed_and_the_trust_region(tmp_path: Path) -> None:
    settings = {"trainer": {"ppo": {"minibatches": 2}}}
    for mode in ("async", "sync"):
        spec = RunSpec(mode, 10, seed=3, settings=settings)
        path = tmp_path / f"{mode}.toml"
        path.write_text(to_toml(spec.config(tmp_path, tmp_path / "run")))
        config = load_config(path)
        assert config.trainer.ppo.minibatches == 2
        assert config.profile.model == "tiny:seed=3"
        assert config.trainer.engine.seed == 3
        assert config.producers.engine.seed == config.producers.rollout.seed == 3
        assert config.trainer.ledger_file == tmp_path / "run" / "ledger.jsonl"


def test_the_pipeline_cell_runs_the_grid_cells_settings(tmp_path: Path) -> None:
    route = next(r for r in ROUTES if r.name == "decoupled-mis")
    grid = Settings()
    spec = RunSpec("async", 300, seed=1, task=grid.task, settings=pipeline_settings(route, grid, 2))
    path = tmp_path / "cell.toml"
    path.write_text(to_toml(spec.config(tmp_path, tmp_path / "run")))
    config = load_config(path)
    assert config.producers.rollout.task == "reverse-3-digits"
    assert config.producers.rollout.group_size == grid.group_size
    assert config.trainer.batch.max_groups == grid.prompts_per_step
    assert config.trainer.engine.lr == grid.lr
    assert (config.trainer.ppo.epochs, config.trainer.ppo.minibatches) == (1, 2)
    loss = config.trainer.loss
    assert (loss.type, loss.correction, loss.mis_weight) == ("decoupled", "mis", "discrepancy")
    assert config.streams.staleness.max_staleness == config.trainer.staleness.max_staleness == 2


def test_trainer_rows_become_a_cell_and_a_staleness_histogram() -> None:
    rows = [
        _row(1, **{"staleness/hist/0": 16.0, "staleness/hist/1": 0.0, "clip/frac": 0.1}),
        _row(2, **{"staleness/hist/0": 8.0, "staleness/hist/2": 8.0, "mis/masked_frac": 0.5}),
    ]
    cell = cell_of_rows("decoupled-mis", 2, 0, rows)
    assert cell.rewards == [0.5, 0.5] and cell.versions == [0, 1]
    assert cell.clip_frac == [0.1, 0.0] and cell.mask_frac == [0.0, 0.5]
    assert staleness_histogram(rows) == {"0": 24, "1": 0, "2": 8}
    other = cell_of_rows("x", 2, 1, [{**r, "reward/mean": 0.7} for r in rows])
    assert curve_gap([cell], [other]) == pytest.approx(0.2)
    assert curve_gap([cell], [cell]) == 0.0


def _fake_run(tmp_path: Path, mode: str, seed: int, step_s: float, reward: float) -> Run:
    """A finished run's files as ``rollstream up`` leaves them, and its samples."""
    run_dir = tmp_path / f"{mode}-{seed}"
    (run_dir / "logs").mkdir(parents=True)
    for role in ("trainer", "producer"):
        (run_dir / "logs" / f"{role}.log").write_text("")
    rows = [
        {
            "step": float(s),
            "reward/mean": reward * s / 20,
            "time/unix_s": 1000.0 + s * step_s,
            "time/step_s": 0.05,
        }
        for s in range(1, 21)
    ]
    (run_dir / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [
        Sample(
            s,
            0.1 * s,
            0.05 * s,
            tokens=100.0 * s,
            records=9.0 * s,
            interrupted=0.5 * s,
            cpu_s={"engine": 0.1 * s, "machine": 0.3 * s},
        )
        for s in range(0, 21, 2)
    ]
    return Run(RunSpec(mode, 20, seed), run_dir, samples, seconds=30.0)


def test_the_report_prints_the_bound_the_fraction_and_the_verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {
        seed: {
            "async": _fake_run(tmp_path, "async", seed, step_s=0.25, reward=0.8),
            "sync": _fake_run(tmp_path, "sync", seed, step_s=0.5, reward=0.6),
        }
        for seed in (0, 1)
    }
    report(runs, {"async": [0.5, 1.0], "sync": [0.4]}, cores=2, pin=True)
    out = capsys.readouterr().out
    # phases 0.1 + 0.05 + 0.05 = 0.2 s a step, largest 0.1: bound 2x; pinned 2x too
    assert "overlap bound, sum / max (a core per phase): 2.00x" in out
    assert "async speed-up in steps/s (median): 2.00x" in out  # 0.5 s vs 0.25 s a step
    assert "steps/s 1.00 of it" in out
    assert "bottleneck: generate" in out
    assert "final reward no lower than sync's: met" in out
    # target 0.9 x 0.465 (sync's best 10-step mean): async at step 15 (3.5 s), sync 19 (9 s)
    assert "to the same reward: 1.29, met" in out
    assert "cores busy (machine CPU s / wall s): async 1.20, sync 0.60" in out
    assert "records produced per trained step: async 9.0, sync 9.0" in out
    assert "samples cut by a version change per step: async 0.5, sync 0.5" in out
    assert "allows at best 0.150s a step: a speed-up of 3.33x over sync" in out  # 0.5 / 0.15
