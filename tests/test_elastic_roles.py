"""Roles join and leave a running run: while ``rollstream up`` trains, a second producer
(with its own engine) and a second stream worker are started by hand from the run's own
config file, then stopped, one by SIGTERM, one by SIGKILL. Nothing may be lost or trained
twice (``rollstream audit``), and the run goes on to its last step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import KafkaConfig, S3Config, to_toml
from core.process import free_port, pid_alive, port_open
from producers.ledger import read_ledger

pytestmark = pytest.mark.slow

STEPS = 100  # long enough for roles that join to start (about 20 s) and work a while


def _config(path: Path, kafka: KafkaConfig, s3: S3Config, unique) -> Path:
    topics = {name: unique(f"rollouts.{name}") for name in ("raw", "scored", "stale", "dlq")}
    versions = unique("policy.versions")
    data = {
        "run_id": unique("elastic"),
        "state_dir": str(path / "state"),
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "s3": s3.model_dump(mode="python"),
        "weights": {"topic": versions},
        "producers": {"rollout": {"topic": topics["raw"]}},
        # a worker that leaves hands its partitions over after this
        "streams": {"topics": {**topics, "versions": versions}, "session_timeout_s": 10.0},
        "trainer": {
            "topics": {
                "scored": topics["scored"],
                "dlq": topics["dlq"],
                "stale": topics["stale"],
                "versions": versions,
            }
        },
    }
    config = path / "base.toml"
    config.write_text(to_toml(data))
    return config


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}


def _rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "trainer.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_rows(run_dir: Path, n: int, up: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_rows(run_dir)) < n:
        if up.poll() is not None or time.monotonic() > deadline:
            up.send_signal(signal.SIGINT)
            out = up.communicate(timeout=120)[0].decode(errors="replace")
            pytest.fail(f"waiting for {n} trainer steps:\n{out[-4000:]}")
        time.sleep(0.5)


def _steps_per_s(rows: list[dict[str, float]]) -> float:
    if len(rows) < 2:
        return 0.0
    return (len(rows) - 1) / (rows[-1]["time/unix_s"] - rows[0]["time/unix_s"])


def test_a_producer_and_a_stream_worker_join_and_leave_a_running_run(
    kafka_config: KafkaConfig, s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    base = _config(tmp_path, kafka_config, s3_config, unique_name)
    run_dir = tmp_path / "run"
    up = subprocess.Popen(
        [sys.executable, "-m", "rollstream", "--config", str(base), "up",
         "--max-steps", str(STEPS), "--run-dir", str(run_dir)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    run_config = run_dir / "rollstream.toml"
    rs = [sys.executable, "-m", "rollstream", "--config", str(run_config)]
    engine_port, streams_port = free_port(), free_port()
    logs = tmp_path / "by-hand"
    logs.mkdir()
    joined: dict[str, subprocess.Popen[bytes]] = {}
    try:
        _wait_rows(run_dir, 8, up, timeout_s=300)
        before = len(_rows(run_dir))
        commands = {
            "engine": [*rs, "serve", "--port", str(engine_port)],
            "producer": [*rs, "--set", f"producers.rollout.metrics_port={free_port()}",
                         "produce", "--engine-url", f"http://127.0.0.1:{engine_port}",
                         "--producer-id", "joined-0"],
            "streams": [*rs, "--set", f"streams.metrics_port={streams_port}",
                        "stream", f"--datadir={tmp_path / 'streams-joined'}"],
        }  # fmt: skip
        for name, argv in commands.items():
            log = (logs / f"{name}.log").open("wb")
            joined[name] = subprocess.Popen(argv, env=_env(), stdout=log, stderr=log)
            if name == "engine":  # as up does: the producer starts once its engine answers
                deadline = time.monotonic() + 180
                while not port_open(engine_port):
                    assert joined["engine"].poll() is None, (logs / "engine.log").read_text()
                    assert time.monotonic() < deadline, "the joined engine did not start"
                    time.sleep(0.5)
        # the joined roles really work: the producer delivers, the stream worker serves
        ledger = next((tmp_path / "state" / "producers").glob("*/joined-0/ledger.jsonl"), None)
        deadline = time.monotonic() + 300
        while ledger is None or len(read_ledger(ledger).delivered) < 4 or not port_open(
            streams_port
        ):
            for name, proc in joined.items():
                assert proc.poll() is None, (logs / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the joined roles did not start working"
            time.sleep(0.5)
            ledger = next((tmp_path / "state" / "producers").glob("*/joined-0/ledger.jsonl"), None)
        _wait_rows(run_dir, len(_rows(run_dir)) + 6, up, timeout_s=300)
        for name, proc in joined.items():
            assert proc.poll() is None, (logs / f"{name}.log").read_text()[-3000:]
        during = len(_rows(run_dir))
        joined["producer"].send_signal(signal.SIGTERM)  # finishes or drops its groups
        assert joined["producer"].wait(120) == 0, (logs / "producer.log").read_text()[-3000:]
        joined["streams"].send_signal(signal.SIGKILL)  # its partitions move back
        joined["streams"].wait(30)
        joined["engine"].send_signal(signal.SIGTERM)
        joined["engine"].wait(60)
        out = up.communicate(timeout=600)[0].decode(errors="replace")
        assert up.returncode == 0, out[-4000:]
    finally:
        for proc in joined.values():
            if proc.poll() is None:
                proc.kill()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=120)

    rows = _rows(run_dir)
    assert len(rows) == STEPS
    rates = (
        _steps_per_s(rows[:before]),
        _steps_per_s(rows[before:during]),
        _steps_per_s(rows[during:]),
    )
    before_s, with_s, after_s = rates
    print(f"trainer steps/s before {before_s:.2f}, with {with_s:.2f}, after {after_s:.2f}")

    audit = subprocess.run(
        [*rs, "audit", "--json"], env=_env(), capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    figures = json.loads(audit.stdout)
    assert figures["problems"] == [] and figures["trained_twice"] == 0
    assert figures["producers"] == 2  # the joined producer's deliveries are accounted too
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not [pid for pid in summary["pids"].values() if pid_alive(pid)]
