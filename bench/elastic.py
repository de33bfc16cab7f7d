"""Roles joining and leaving a running run: throughput before, during and after, and the
audit at the end.

Run from the repository root: ``python -m bench.elastic [--phase-s 60]``.

On its own embedded broker and store, ``rollstream up`` runs the tiny default (one
engine, producer, stream worker and trainer). Then, as a user on another machine would,
with nothing but the run's config file:

1. **before**: ``phase_s`` seconds of the run as started;
2. **joined**: one more engine + producer (``rollstream serve`` / ``produce``) and one more
   stream worker (``rollstream stream``) join; once the producer has delivered and the
   stream worker holds raw partitions and the trainer has stepped again, ``phase_s``
   seconds are measured (the pause until that step is reported apart: the joining
   worker restores its tables and rebuilds old-logit snapshots first);
3. **after**: the joined producer is stopped with SIGTERM (it finishes or aborts its
   groups in flight and says which in its ledger) and the joined stream worker with
   SIGKILL of its process group, supervisor and worker, as if its machine died (its
   partitions go back to the first worker when its session times out);
   once the consumer group has one member again and the trainer has stepped again,
   ``phase_s`` seconds are measured.

Then ``up`` is stopped as a user stops it (Ctrl-C: SIGINT), the run's own config file
brings the embedded services back (``infra up``) and ``rollstream audit`` reconciles every
producer's ledger with the trainer's: nothing lost, nothing trained twice. Figures per phase:
trainer steps/s, trained trajectories/s and groups delivered per second by all producers.
``run_elastic`` returns them with what the presence topic said at each point; the slow
test ``tests/system/rollstream/test_elastic_roles.py`` runs it short and asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import to_toml
from core.process import free_port
from rollstream.config.settings import RollstreamConfig, load_config

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Phase:
    """Throughput over one measured window."""

    name: str
    seconds: float
    steps_per_s: float
    trajectories_per_s: float
    groups_delivered_per_s: float


@dataclass
class ElasticReport:
    """What ``run_elastic`` saw."""

    run_id: str
    run_dir: Path
    phases: list[Phase] = field(default_factory=list)
    roles_joined: dict[str, Any] = field(default_factory=dict)  # `rollstream roles --json`
    roles_after: dict[str, Any] = field(default_factory=dict)
    roles_before: dict[str, Any] = field(default_factory=dict)
    joined_stop: dict[str, Any] = field(default_factory=dict)  # the ledger's stopped line
    joined_groups: int = 0  # groups the joined producer delivered
    joined_raw_partitions: int = 0  # the joined stream worker's own metric
    joined_first_version: int | None = None  # lowest version in its records
    version_at_join: int = 0  # the trainer's version when it was started
    join_pause_s: float = 0.0  # joined worker holding partitions -> the trainer's next step
    leave_pause_s: float = 0.0  # one worker holding them all again -> the next step
    audit: dict[str, Any] = field(default_factory=dict)
    up_exit: int | None = None
    role_pids: dict[str, int] = field(default_factory=dict)  # up's pids.json before Ctrl-C
    infra_up_s: float = 0.0  # `infra up` from the run's config file after up stopped
    infra_up_stderr: str = ""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _rollstream(config: Path, *args: str, log: Path) -> subprocess.Popen[bytes]:
    """A command in a session of its own, so that killing its process group kills the
    command and the processes it started (``rollstream stream`` runs its worker as a
    child), as losing a machine would."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollstream", "--config", str(config), *args],
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )


def _rollstream_json(config: Path, *args: str, timeout_s: float = 300) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config), *args, "--json"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(  # audit exits 1 with its figures and problems on stdout
            f"rollstream {' '.join(args)} exited {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return dict(json.loads(done.stdout))


def _wait(what: str, ready: Callable[[], bool], timeout_s: float, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(poll_s)


def _served_url(log: Path, process: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The URL ``rollstream serve`` says it serves at (its ``... API at URL`` line)."""
    found: list[str] = []

    def said() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited with {process.returncode}: {log}")
        for line in log.read_text(errors="replace").splitlines():
            if "'s API at http://" in line:
                found.append(line.rsplit(" at ", 1)[1].strip())
                return True
        return False

    _wait("the engine's address", said, timeout_s, poll_s=0.2)
    return found[0]


def _healthy(url: str, process: subprocess.Popen[bytes]) -> bool:
    import urllib.request

    if process.poll() is not None:
        raise RuntimeError(f"{url}: the engine exited with {process.returncode}")
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _trainer_rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "trainer.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _delivered_stamps(state_dir: Path, run_id: str) -> list[float]:
    """Seconds (unix) at which any producer of the run had a group acknowledged."""
    from producers.rollout.ledger import LEDGER_NAME

    stamps = []
    for ledger in (state_dir / "producers" / run_id).glob(f"*/{LEDGER_NAME}"):
        for line in ledger.read_text().splitlines():
            if '"kind":"delivered"' in line:
                stamps.append(json.loads(line)["ts_ms"] / 1000)
    return stamps


def _wait_for_step(run_dir: Path, since: float, timeout_s: float) -> float:
    """Seconds from ``since`` (unix) until the trainer logged a step after it."""

    def stepped() -> bool:
        return any(row["time/unix_s"] > since for row in _trainer_rows(run_dir))

    _wait("a trainer step", stepped, timeout_s, poll_s=0.2)
    return time.time() - since


def measure(name: str, seconds: float, run_dir: Path, state_dir: Path, run_id: str) -> Phase:
    """Trainer and producer throughput over the next ``seconds``."""
    began = time.time()
    time.sleep(seconds)
    ended = time.time()
    rows = [r for r in _trainer_rows(run_dir) if began <= r["time/unix_s"] < ended]
    trained = sum(r.get("data/trajectories", 0.0) for r in rows)
    groups = [t for t in _delivered_stamps(state_dir, run_id) if began <= t < ended]
    phase = Phase(name, ended - began, len(rows) / (ended - began), trained / (ended - began),
                  len(groups) / (ended - began))  # fmt: skip
    print(
        f"{name:<7} {phase.steps_per_s:.2f} steps/s  {phase.trajectories_per_s:.1f} traj/s  "
        f"{phase.groups_delivered_per_s:.2f} groups delivered/s",
        flush=True,
    )
    return phase


def _joined_records(config: RollstreamConfig, producer_id: str) -> list[int]:
    """The lowest segment version of each record the joined producer put in raw."""
    from confluent_kafka import Consumer

    from core.topic_reader import read_range, reader_config, whole_topic
    from schemas.codec import decode

    kafka = config.kafka.client_config()
    consumer = Consumer(reader_config(kafka, "elastic"))
    versions = []
    try:
        topic = config.producers.rollout.topic
        for msg in read_range(consumer, topic, whole_topic(consumer, topic)):
            record = decode(msg.value())
            if record.producer_id == producer_id and record.run_id == config.run_id:
                versions.append(int(min(record.segment_versions)))
    finally:
        consumer.close()
    return versions


def run_elastic(tmp: Path, phase_s: float = 60.0, timeout_s: float = 600.0) -> ElasticReport:
    """The scenario of the module doc on fresh embedded services under ``tmp``."""
    from infra.services import Services
    from producers.rollout.ledger import LEDGER_NAME, read_ledger
    from rollstream.debug.roles import run_roles

    state = tmp / "state"
    run_id = f"elastic-{int(time.time())}"
    run_dir = state / "runs" / run_id
    tmp.mkdir(parents=True, exist_ok=True)
    base = tmp / "base.toml"
    # A killed stream worker's partitions move after its session times out; it is told
    # silent after three missed heartbeats.
    settings = {
        "state_dir": str(state),
        "streams": {"session_timeout_s": 10.0},
        "presence": {"interval_s": 2.0},
    }
    base.write_text(to_toml(settings))
    report = ElasticReport(run_id, run_dir)
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    up = _rollstream(
        base, "up", "--max-steps", "100000", "--run-id", run_id, "--run-dir", str(run_dir),
        log=logs / "up.log",
    )  # fmt: skip
    joined: dict[str, subprocess.Popen[bytes]] = {}
    try:
        config_path = run_dir / "rollstream.toml"
        _wait("up's first step", lambda: len(_trainer_rows(run_dir)) >= 1, timeout_s)
        config = Services(load_config(config_path)).resolved()
        report.phases.append(measure("before", phase_s, run_dir, state, run_id))
        report.roles_before = _rollstream_json(config_path, "roles")

        # --- join: one more engine + producer, one more stream worker ---------------------
        report.version_at_join = int(_trainer_rows(run_dir)[-1]["version"])
        producer_id = f"{run_id}-producer-joined"
        # port 0: the engine binds a free port itself and says which (a port picked here
        # could be taken by another process before the engine binds it)
        joined["engine"] = _rollstream(
            config_path, "serve", "--port", "0", log=logs / "engine-joined.log"
        )
        engine_url = _served_url(logs / "engine-joined.log", joined["engine"], timeout_s)
        engine_port = int(engine_url.rsplit(":", 1)[1])
        _wait(
            "the joined engine",
            lambda: _healthy(f"http://127.0.0.1:{engine_port}/health", joined["engine"]),
            timeout_s,
        )
        joined["producer"] = _rollstream(
            config_path, "--set", f"producers.rollout.metrics_port={free_port()}", "produce",
            "--engine-url", f"http://127.0.0.1:{engine_port}", "--producer-id", producer_id,
            log=logs / "producer-joined.log",
        )  # fmt: skip
        streams_metrics_port = free_port()
        joined["streams"] = _rollstream(
            config_path, "--set", f"streams.metrics_port={streams_metrics_port}", "stream",
            f"--datadir={run_dir / 'streams' / 'joined'}", log=logs / "streams-joined.log",
        )  # fmt: skip
        ledger = state / "producers" / run_id / producer_id / LEDGER_NAME

        def both_joined() -> bool:
            for name, process in joined.items():
                if process.poll() is not None:
                    raise RuntimeError(f"the joined {name} exited with {process.returncode}")
            if not ledger.exists() or not read_ledger(ledger).delivered:
                return False
            roles = run_roles(config)  # both hold partitions and beat (Faust is ready)
            held = len([w for w in roles.stream_lag if w.partitions])
            return held >= 2 and roles.count("streams") >= 2 and roles.count("producer") >= 2

        _wait("the joined producer and stream worker", both_joined, timeout_s)
        report.roles_joined = _rollstream_json(config_path, "roles")

        def partitions_in_metrics() -> bool:
            from rollstream.up.display import scrape

            found = scrape(streams_metrics_port).get("rollstream_streams_raw_partitions")
            report.joined_raw_partitions = int(found or 0)
            return bool(found)

        _wait("the joined worker's partitions in its metrics", partitions_in_metrics, 60)
        # The phase measures the run with both joined, so it starts once the trainer
        # steps again: a joining worker first restores its tables and rebuilds old-logit
        # snapshots, a pause measured apart (``join_pause_s``).
        report.join_pause_s = _wait_for_step(run_dir, time.time(), timeout_s)
        report.phases.append(measure("joined", phase_s, run_dir, state, run_id))

        # --- leave: SIGTERM the producer, SIGKILL the stream worker -----------------------
        joined["producer"].send_signal(signal.SIGTERM)
        os.killpg(joined["streams"].pid, signal.SIGKILL)  # the supervisor and its worker
        joined["producer"].wait(120)
        joined["engine"].send_signal(signal.SIGTERM)
        joined["engine"].wait(60)
        joined["streams"].wait(30)
        stops = read_ledger(ledger).stops
        report.joined_stop = stops[-1].__dict__ if stops else {}
        report.joined_groups = len(read_ledger(ledger).delivered)
        _wait(
            "the stream group back to one worker",
            lambda: len([w for w in run_roles(config).stream_lag if w.partitions]) == 1,
            timeout_s,
        )
        report.leave_pause_s = _wait_for_step(run_dir, time.time(), timeout_s)
        report.phases.append(measure("after", phase_s, run_dir, state, run_id))

        def streams(roles: dict[str, Any]) -> set[str]:
            return {b["instance"] for b in roles["active"] if b["role"] == "streams"}

        # A killed worker stops beating: silent after three heartbeat intervals.
        killed = streams(report.roles_joined) - streams(report.roles_before)
        _wait(
            "the killed stream worker told silent",
            lambda: killed <= {b.instance for b in run_roles(config).presence.silent},
            3 * config.presence.interval_s + 30,
        )
        report.roles_after = _rollstream_json(config_path, "roles")
        versions = _joined_records(config, producer_id)
        report.joined_first_version = min(versions) if versions else None
    finally:
        for process in joined.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        pids_file = run_dir / "pids.json"
        report.role_pids = json.loads(pids_file.read_text() or "{}") if pids_file.exists() else {}
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        report.up_exit = up.wait(180)
    # `up` stopped the embedded services it started: the run's file brings them back.
    config_path = run_dir / "rollstream.toml"
    started = time.monotonic()
    infra = subprocess.run(
        [sys.executable, "-m", "rollstream", "--config", str(config_path), "infra", "up"],
        env=_env(), capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    report.infra_up_s = time.monotonic() - started
    report.infra_up_stderr = infra.stderr
    try:
        report.audit = _rollstream_json(config_path, "audit")
    finally:
        subprocess.run(
            [sys.executable, "-m", "rollstream", "--config", str(config_path), "infra", "down"],
            env=_env(), capture_output=True, timeout=180, check=False,
        )  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=60.0, help="Seconds per phase.")
    parser.add_argument("--out", type=Path, help="Keep the run here (default: a temp dir).")
    args = parser.parse_args()
    import tempfile

    tmp = args.out or Path(tempfile.mkdtemp(prefix="rollstream-elastic-"))
    print(f"elastic roles: {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, tiny model")
    report = run_elastic(tmp, args.phase_s)
    before, during, after = report.phases
    print(
        f"steps/s joined/before {during.steps_per_s / max(before.steps_per_s, 1e-9):.2f}x, "
        f"after/before {after.steps_per_s / max(before.steps_per_s, 1e-9):.2f}x; "
        f"groups delivered/s joined/before "
        f"{during.groups_delivered_per_s / max(before.groups_delivered_per_s, 1e-9):.2f}x"
    )
    print(
        f"until the trainer's next step: after the join {report.join_pause_s:.1f}s, "
        f"after the leave {report.leave_pause_s:.1f}s"
    )
    print(f"joined producer: {report.joined_groups} groups, stop {report.joined_stop}")
    print(
        f"joined producer's lowest version {report.joined_first_version} "
        f"(trainer at v{report.version_at_join} when it started)"
    )
    audit = report.audit
    print(
        f"audit: problems {audit.get('problems')}, delivered {audit.get('delivered')}, "
        f"trained {audit.get('trained')}, trained twice {audit.get('trained_twice')}, "
        f"missing {audit.get('missing')}"
    )


if __name__ == "__main__":
    main()
