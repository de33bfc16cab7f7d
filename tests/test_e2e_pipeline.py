"""End to end: ``rollstream up`` runs producers → streams → trainer as separate processes
on the session's real Kafka broker and SeaweedFS store, and the tiny model learns.

Both tests start ``rollstream up`` as a subprocess (as a user would), with a config that
points to the fixtures' services (so nothing embedded starts) and uses unique topic names
(so other tests' data never meets this run's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core.config import KafkaConfig, S3Config, to_toml
from core.process import pid_alive

pytestmark = pytest.mark.slow

# measured 2026-11-22 (2 shared cores): first 10 steps 0.064, last 10 steps 0.538, 69 s
STEPS = 80
MIN_GAIN = 0.15


def _config(
    path: Path, kafka: KafkaConfig, s3: S3Config, unique: Callable[[str], str], run_id: str
) -> Path:
    topics = {name: unique(f"rollouts.{name}") for name in ("raw", "scored", "stale", "dlq")}
    versions = unique("policy.versions")
    data = {
        "run_id": run_id,
        "state_dir": str(path / "state"),
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "s3": s3.model_dump(mode="python"),
        "weights": {"topic": versions},
        "producers": {"rollout": {"topic": topics["raw"]}},
        "streams": {"topics": {**topics, "versions": versions}},
        "trainer": {
            "topics": {
                "scored": topics["scored"],
                "dlq": topics["dlq"],
                "stale": topics["stale"],
                "versions": versions,
            }
        },
    }
    config = path / "rollstream.toml"
    config.write_text(to_toml(data))
    return config


def _up(config: Path, run_dir: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return subprocess.Popen(
        [sys.executable, "-m", "rollstream", "--config", str(config), "up",
         "--run-dir", str(run_dir), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """Output of ``proc``; on timeout it is stopped (SIGINT, as Ctrl-C) and the test fails.

    Any other interruption of the wait (pytest-timeout's, Ctrl-C) kills ``up`` at once, and
    its roles die with it: left running, they would slow every later test."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return out
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=150)  # up stops each role within 30 s
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"rollstream up ran over {timeout_s}s:\n{out.decode(errors='replace')[-4000:]}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "trainer.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(row[key] for row in rows) / len(rows)


def _run_up(
    tmp_path: Path, config: Path, timeout_s: float, *args: str
) -> tuple[Path, list[dict[str, float]]]:
    """``rollstream up *args`` to its end; the run directory and the trainer's rows."""
    run_dir = tmp_path / "run"
    proc = _up(config, run_dir, *args)
    out = _finish(proc, timeout_s=timeout_s)
    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    return run_dir, _rows(run_dir)


def _assert_learned(rows: list[dict[str, float]], steps: int, min_gain: float) -> None:
    """Every step ran, and the mean reward of the last 10 beats the first 10's."""
    assert len(rows) == steps
    first, last = _mean(rows[:10], "reward/mean"), _mean(rows[-10:], "reward/mean")
    assert last >= first + min_gain, (first, last)


def _assert_reconciles(run_dir: Path, rows: list[dict[str, float]]) -> None:
    """``rollstream audit`` of the run: nothing lost, nothing twice, every trained record
    in the trainer's metrics."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    audit = subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(run_dir / "rollstream.toml"),
         "audit", "--json"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    figures = json.loads(audit.stdout)
    assert figures["problems"] == [] and figures["missing"] == 0
    assert figures["trained_twice"] == 0
    assert figures["trained"] == sum(row["data/trajectories"] for row in rows)


def test_pipeline_learns_the_tiny_task(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    config = _config(tmp_path, kafka_config, s3_config, unique_name, unique_name("e2e"))
    run_dir, rows = _run_up(tmp_path, config, 420, "--max-steps", str(STEPS))
    _assert_learned(rows, STEPS, MIN_GAIN)
    # exact old logits on every record, engine and trainer numerics agree (both fp32)
    assert all(row["data/exact_old_frac"] == 1.0 for row in rows)
    assert max(row["mismatch/k3_kl"] for row in rows) < 1e-6
    # streams admit records at most the window (2) behind the trainer *when they assemble
    # the group*; the trainer may move on by up to the window again before it trains them
    assert max(row["staleness/max"] for row in rows) <= 4
    assert rows[-1]["data/dlq_total"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == STEPS
    assert not [pid for pid in summary["pids"].values() if pid_alive(pid)]


def test_sigint_to_up_leaves_no_role_behind(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    config = _config(tmp_path, kafka_config, s3_config, unique_name, unique_name("e2e-int"))
    run_dir = tmp_path / "run"
    proc = _up(config, run_dir, "--max-steps", "10000")
    deadline = time.monotonic() + 240
    pids: dict[str, int] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        pids_file = run_dir / "pids.json"
        if pids_file.exists():
            pids = json.loads(pids_file.read_text() or "{}")
        if len(pids) == 4 and _rows(run_dir):  # every role up and training
            break
        time.sleep(0.5)
    if proc.poll() is not None or len(pids) != 4:
        proc.send_signal(signal.SIGINT)
        pytest.fail(_finish(proc, timeout_s=120).decode(errors="replace")[-4000:])
    proc.send_signal(signal.SIGINT)
    out = _finish(proc, timeout_s=180)
    assert proc.returncode == 130, out.decode(errors="replace")[-4000:]
    assert not [name for name, pid in pids.items() if pid_alive(pid)]
    marker = str(run_dir / "rollstream.toml").encode()
    strays = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and marker in _cmdline(p)]
    assert not strays, strays


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


# measured 2026-11-24 (2 shared cores, embedded services): first 10 steps 0.077, last 10
# steps 0.669, 232 s
ECHO_STEPS = 80
ECHO_MIN_GAIN = 0.25


@pytest.mark.timeout(900)  # up's own 600 s, then its stop, come first
def test_pipeline_learns_the_multi_turn_echo_environment_and_reconciles(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    config = _config(tmp_path, kafka_config, s3_config, unique_name, unique_name("echo"))
    args = ("--task", "echo-digits", "--max-steps", str(ECHO_STEPS))
    run_dir, rows = _run_up(tmp_path, config, 600, *args)
    _assert_learned(rows, ECHO_STEPS, ECHO_MIN_GAIN)
    # episodes of three policy turns and two environment turns, every one ended by the
    # environment; exact old logits over policy tokens, engine and trainer agree
    assert all(row["episode/end/done"] == row["data/trajectories"] for row in rows)
    assert all(0.25 < row["episode/env_token_share"] < 0.6 for row in rows)
    assert all(row["data/exact_old_frac"] == 1.0 for row in rows)
    assert max(row["mismatch/k3_kl"] for row in rows) < 1e-6

    _assert_reconciles(run_dir, rows)


@pytest.mark.timeout(900)  # up's own 600 s, then its stop, come first
def test_pipeline_learns_with_two_trainer_ranks_and_reconciles(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    config = _config(tmp_path, kafka_config, s3_config, unique_name, unique_name("ranks"))
    args = ("--trainer-ranks", "2", "--max-steps", str(STEPS))
    run_dir, rows = _run_up(tmp_path, config, 600, *args)
    _assert_learned(rows, STEPS, MIN_GAIN)
    assert all(row["ranks/world"] == 2.0 for row in rows)
    assert all(row["data/exact_old_frac"] == 1.0 for row in rows)
    _assert_reconciles(run_dir, rows)


@pytest.mark.timeout(900)  # up's own 600 s, then its stop, come first
def test_smollm2_runs_the_calculator_environment_end_to_end(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    config = _config(tmp_path, kafka_config, s3_config, unique_name, unique_name("calc"))
    args = ("--model", "smollm2-135m", "--task", "arithmetic-calculator",
            "--max-steps", "2", "--groups-per-step", "1")  # fmt: skip
    _run_dir, rows = _run_up(tmp_path, config, 600, *args)
    assert len(rows) == 2
    for row in rows:  # episodes, scored per episode, old logits exact over policy tokens
        assert row["data/trajectories"] == 8 and row["data/exact_old_frac"] == 1.0
        assert "episode/tool_calls_total" in row and "episode/turns_mean" in row
        assert sum(v for k, v in row.items() if k.startswith("episode/end/")) == 8


@pytest.mark.timeout(900)  # up's own 600 s, then its stop, come first
def test_smollm2_trains_the_arithmetic_profile_and_reconciles(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    """What a new user runs first on a real model (``--model smollm2-135m``, the default
    task and profile), a few steps: every step trains whole groups with exact old logits
    and a reward signal (the format reward alone makes a zero-reward step all but
    impossible), and the audit reconciles. The longer run is in the docs."""
    config = _config(tmp_path, kafka_config, s3_config, unique_name, unique_name("smol"))
    args = ("--model", "smollm2-135m", "--max-steps", "3", "--groups-per-step", "2")
    run_dir, rows = _run_up(tmp_path, config, 600, *args)
    assert len(rows) == 3
    for row in rows:
        assert row["data/trajectories"] == 16 and row["data/exact_old_frac"] == 1.0
        assert row["reward/mean"] > 0.0
    _assert_reconciles(run_dir, rows)
