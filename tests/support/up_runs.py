"""Runs of ``rollstream up`` as a subprocess, as a user starts it, for the system tests.

A run's config points at the session's broker and store (so nothing embedded starts) and
names its topics uniquely (so other tests' data never meets this run's). ``run_up`` waits
for ``up`` to stop at its ``max_steps``; the trainer's metric rows and ``rollstream audit``
are what the tests then read.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.config import KafkaConfig, S3Config, merge_tables, to_toml


def role_env(pythonpath: Path | None = None) -> dict[str, str]:
    """The test process's environment without its ``ROLLSTREAM_*`` overrides, with
    ``pythonpath`` first on ``PYTHONPATH`` (where a run's user modules are)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    if pythonpath is not None:
        paths = (str(pythonpath), env.get("PYTHONPATH"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def write_config(
    path: Path,
    kafka: KafkaConfig,
    s3: S3Config,
    run_id: str,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """``path/rollstream.toml`` for a run on the given services, topics suffixed uniquely;
    ``extra`` tables are merged on top (key by key)."""
    suffix = uuid.uuid4().hex[:8]
    topics = {name: f"rollouts.{name}-{suffix}" for name in ("raw", "scored", "stale", "dlq")}
    versions = f"policy.versions-{suffix}"
    data: dict[str, Any] = {
        "run_id": run_id,
        "state_dir": str(path / "state"),
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "s3": s3.model_dump(mode="python"),
        "weights": {"topic": versions},
        "presence": {"topic": f"rollstream.roles-{suffix}"},
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
    config.write_text(to_toml(merge_tables(data, dict(extra or {}))))
    return config


def start_up(
    config: Path, run_dir: Path, *args: str, pythonpath: Path | None = None
) -> subprocess.Popen[bytes]:
    """``rollstream --config CONFIG up --run-dir RUN_DIR *args``, output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "rollstream", "--config", str(config), "up",
         "--run-dir", str(run_dir), *args],
        env=role_env(pythonpath),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def finish(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
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


def metric_rows(run_dir: Path) -> list[dict[str, float]]:
    """The trainer's metric rows (``trainer.jsonl``), one per step."""
    path = run_dir / "trainer.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(row[key] for row in rows) / len(rows)


@dataclass(frozen=True)
class UpRun:
    """A finished ``rollstream up``: its run directory, the trainer's rows, its output."""

    run_dir: Path
    rows: list[dict[str, float]]
    output: str


def run_up(
    path: Path,
    config: Path,
    timeout_s: float,
    *args: str,
    pythonpath: Path | None = None,
    run_dir: Path | None = None,
) -> UpRun:
    """``rollstream up *args`` to its end, in ``run_dir`` (default ``path/run``); it must
    exit 0."""
    run_dir = run_dir or path / "run"
    proc = start_up(config, run_dir, *args, pythonpath=pythonpath)
    out = finish(proc, timeout_s=timeout_s).decode(errors="replace")
    assert proc.returncode == 0, out[-4000:]
    return UpRun(run_dir, metric_rows(run_dir), out)


# Calibrated 2026-11-29 from six runs of the tiny e2e run (130 steps, 2 shared cores under
# load average 3-4 from other test runs): reward of the first 10 steps 0.055-0.068, of the
# last 10 0.67-0.90 (gain 0.61-0.85); digits right 0.86, 0.81, 0.89, 0.70, 0.70, 0.60. The
# bars sit well under the lowest run and well over what learning only the format gives.
# Again 2026-12-07, twelve runs three at a time on the 2 cores: last 10 steps 0.43-0.97
# (gain 0.37-0.90); the slowest run's digits were right 0.341 of the time, under the 0.35
# bar of then, so the bar is 0.3 (three times a format-only policy's 0.1).
TINY_MIN_GAIN = 0.3
"""The tiny run's bar on its reward: last 10 steps over the first 10."""
TINY_MIN_ACCURACY = 0.3
"""The tiny run's bar on content: answer digits right (``digit_accuracy``), where a policy
that learned only the format is right 1 time in 10 (tests/unit/rollstream/test_learning_bars.py)."""


SEED_BLIND_FRAC = 0.1
"""How often a propose-solve proposer blind to its seed digit starts a problem with it."""
SEED_MIN_GAIN = 0.1
"""The proposer's other bar: its seeded fraction, last 10 steps over the first 10."""


def seed_blind_bar(samples: float) -> float:
    """The proposer's content bar (test_multi_policy_e2e): over ``samples`` problems, a
    seed-blind proposer's fraction of seeded ones stays under 0.1 + 4 sd (sd =
    sqrt(0.09 / samples)) in all but one run in ~30,000
    (tests/unit/rollstream/test_learning_bars.py)."""
    return SEED_BLIND_FRAC + 4 * math.sqrt(SEED_BLIND_FRAC * (1 - SEED_BLIND_FRAC) / samples)


def assert_learned(run: UpRun, steps: int, min_gain: float, min_accuracy: float) -> None:
    """Every step ran; the mean reward of the last 10 beats the first 10's by ``min_gain``;
    and the answers of the last versions read the prompt: their digits are right at least
    ``min_accuracy`` of the time (``digit_accuracy``), where a policy that learned only the
    answer's format stays at 1 in 10."""
    rows = run.rows
    assert len(rows) == steps
    first, last = mean(rows[:10], "reward/mean"), mean(rows[-10:], "reward/mean")
    assert last >= first + min_gain, (first, last)
    accuracy = digit_accuracy(late_scored_samples(run.run_dir))
    print(f"reward: first 10 steps {first:.3f}, last 10 {last:.3f}; digits right {accuracy:.3f}")
    assert accuracy >= min_accuracy, (accuracy, first, last)


def run_command(run_dir: Path, *args: str) -> str:
    """``rollstream ARGS`` with the run's own config file; its stdout, after exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(run_dir / "rollstream.toml"), *args],
        env=role_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def audit_figures(run_dir: Path) -> dict[str, Any]:
    """``rollstream audit --json`` of the run."""
    return json.loads(run_command(run_dir, "audit", "--json"))


def exported_dataset(run_dir: Path, out: Path, *options: str) -> Any:
    """``rollstream export-dataset`` of the run, loaded back with
    ``datasets.load_from_disk``."""
    from datasets import load_from_disk

    run_command(run_dir, "export-dataset", "--out", str(out), *options)
    return load_from_disk(str(out))


def assert_reconciles(run_dir: Path, rows: list[dict[str, float]]) -> None:
    """``rollstream audit`` of the run: nothing lost, nothing twice, every trained record
    in the trainer's metrics."""
    figures = audit_figures(run_dir)
    assert figures["problems"] == [] and figures["missing"] == 0
    assert figures["trained_twice"] == 0
    assert figures["trained"] == sum(row["data/trajectories"] for row in rows)


def strays(run_dir: Path) -> list[str]:
    """Processes still running with the run's config file on their command line."""
    marker = str(run_dir / "rollstream.toml").encode()
    return [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and marker in _cmdline(p)]


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


def scored_samples(run_dir: Path) -> list[Any]:
    """Every scored sample of the run (its ``rollouts.scored``)."""
    from confluent_kafka import Consumer

    from core.topic_reader import read_range, reader_config, whole_topic
    from rollstream.config.settings import load_config
    from schemas.group import decode_group

    config = load_config(run_dir / "rollstream.toml")
    topic = config.trainer.topics.scored
    consumer = Consumer(reader_config(config.kafka.client_config(), "scored-samples"))
    try:
        plan = whole_topic(consumer, topic)
        groups = [decode_group(msg.value()) for msg in read_range(consumer, topic, plan)]
    finally:
        consumer.close()
    return [sample for group in groups for sample in group.samples]


def late_scored_samples(run_dir: Path, last_versions: int = 10) -> list[Any]:
    """The scored samples of the run generated by one of its last ``last_versions``
    policy versions: what the policy had learned by the end."""
    samples = scored_samples(run_dir)
    last = max(int(s.segment_versions.max()) for s in samples)
    return [s for s in samples if int(s.segment_versions.min()) > last - last_versions]


def digit_accuracy(samples: list[Any]) -> float:
    """Share of the answer digits that are right, from the records' reward details: a
    policy that does not read its prompt (always the same digits, whatever the format) is
    right 1 time in 10, one that also learned the format still only 1 in 10."""
    right = total = 0
    for sample in samples:
        details = sample.reward_details
        if "turns_correct" in details:  # an episode: one digit per turn
            right += int(details["turns_correct"])
            total += int(details["turns"])
        else:
            target, answer = str(details["target"]), str(details["answer"])
            right += sum(a == t for a, t in zip(answer, target, strict=False))
            total += len(target)
    return right / total
