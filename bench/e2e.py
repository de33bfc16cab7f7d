"""End-to-end benchmark: async vs sync pipeline on the tiny synthetic task.

Run from the repository root: ``python -m bench.e2e [--steps N] [--pin-cores]``.

One embedded Kafka broker and one SeaweedFS store are started in a temporary state
directory; ``rollstream up`` then runs the whole pipeline (engine, producer, stream
worker, trainer as separate processes) twice on them, ``--async`` and ``--sync``, with
the same seed-free defaults and the same number of trainer steps. Reported:

1. **Time to reward.** The target is 90% of the lower of the two runs' best 10-step mean
   reward, so both reach it; wall-clock from the first trained step (pipeline start-up is
   the same for both and reported apart) and steps to reach it, async/sync ratio
   (target: async >= 2x faster) and the final 10-step mean reward of each.
2. **Record latency, produce -> trained**, p50/p99: ``created_at_ms`` (the producer's
   timestamp when the group's generation started, carried in every record) to the
   wall-clock time at the end of the trainer step that trained it (``time/unix_s`` of the
   step in the metrics file, joined through the trainer's ledger of trajectory ids).
3. **Version propagation, publish -> generator** (home region): the trainer's log line
   "published vN" to the producer's "applied vN" (WeightFollower), p50/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from rollstream.config import load_config

MODES = ("async", "sync")
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?(published|applied) v(\d+)")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rows(run_dir: Path) -> list[dict[str, float]]:
    text = (run_dir / "trainer.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _smoothed(rows: list[dict[str, float]], window: int = 10) -> list[float]:
    rewards = [row["reward/mean"] for row in rows]
    return [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]


def run_up(state_dir: Path, tmp: Path, mode: str, steps: int, pin: bool) -> Path:
    """One ``rollstream up`` run on the running infra; returns its run directory."""
    run_id = f"bench-{mode}-{int(time.time())}"
    run_dir = state_dir / "runs" / run_id
    config = tmp / f"{mode}.toml"
    config.write_text(
        f"state_dir = {json.dumps(str(state_dir))}\n[trainer]\n"
        f"ledger_file = {json.dumps(str(run_dir / 'ledger.jsonl'))}\n"
    )
    argv = [sys.executable, "-m", "rollstream", "--config", str(config), "up", f"--{mode}"]
    argv += ["--max-steps", str(steps), "--run-id", run_id, "--run-dir", str(run_dir)]
    argv += ["--pin-cores"] if pin else []
    began = time.time()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=3600)
    print(f"  {mode}: {done.stdout.strip()} ({time.time() - began:.0f}s)")
    if done.returncode != 0:
        raise SystemExit(f"rollstream up --{mode} failed:\n{done.stderr[-3000:]}")
    return run_dir


def time_to(rows: list[dict[str, float]], target: float) -> tuple[float, int] | None:
    """Seconds from the first step's end and steps until the 10-step mean reaches target."""
    start = rows[0]["time/unix_s"]
    for i, value in enumerate(_smoothed(rows)):
        if value >= target:
            return rows[i]["time/unix_s"] - start, i + 1
    return None


def latencies(run_dir: Path, config_path: Path, run_id: str) -> list[float]:
    """Seconds from each trained record's created_at_ms to the end of its trainer step."""
    from confluent_kafka import Consumer, TopicPartition

    from schemas.codec import decode

    step_end = {int(row["step"]): row["time/unix_s"] for row in _rows(run_dir)}
    trained: dict[str, float] = {}
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        for tid in entry["trajectory_ids"]:
            trained[tid] = step_end[int(entry["step"])]
    config = load_config(config_path)
    topic = config.producers.rollout.topic
    consumer = Consumer(
        {**config.kafka.client_config(), "group.id": f"bench-{run_id}", "enable.auto.commit": False}
    )
    parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p))[1] for p in parts}
    done: set[int] = {p for p, end in ends.items() if end == 0}
    out: list[float] = []
    while len(done) < len(parts):
        msg = consumer.poll(2.0)
        if msg is None or msg.error() is not None:
            continue
        if msg.offset() + 1 >= ends[msg.partition()]:
            done.add(msg.partition())
        traj = decode(msg.value())
        if traj.run_id == run_id and traj.trajectory_id in trained:
            out.append(trained[traj.trajectory_id] - traj.created_at_ms / 1000)
    consumer.close()
    return out


def propagation(run_dir: Path) -> list[float]:
    """Seconds from the trainer's "published vN" to the producer's "applied vN"."""

    def stamps(name: str, verb: str) -> dict[int, float]:
        found: dict[int, float] = {}
        for line in (run_dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines():
            match = _LOG_TIME.match(line)
            if match and match.group(2) == verb:
                when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.setdefault(int(match.group(3)), when)
        return found

    published, applied = stamps("trainer", "published"), stamps("producer", "applied")
    return [applied[v] - published[v] for v in published if v in applied and v > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="trainer steps per run")
    parser.add_argument("--pin-cores", action="store_true", help="pin roles to cores")
    args = parser.parse_args()

    from infra.services import Services

    with tempfile.TemporaryDirectory(prefix="rollstream-bench-e2e-") as tmp:
        runs: dict[str, Path] = {}
        lat: dict[str, list[float]] = {}
        for mode in MODES:  # a fresh broker and store per mode: no run sees another's data
            state = Path(tmp) / mode
            services = Services(load_config(None, state_dir=state))
            print(f"{mode}: infra up in {services.up().seconds:.1f}s; {os.cpu_count()} cores")
            try:
                run_dir = run_up(state, Path(tmp), mode, args.steps, args.pin_cores)
                runs[mode] = run_dir
                # read the run's records while its broker still runs
                lat[mode] = latencies(run_dir, run_dir / "rollstream.toml", run_dir.name)
            finally:
                services.down()
        report(runs, lat)


def report(runs: dict[str, Path], lat_by_mode: dict[str, list[float]]) -> None:
    rows = {mode: _rows(run_dir) for mode, run_dir in runs.items()}
    best = {mode: max(_smoothed(r)) for mode, r in rows.items()}
    target = 0.9 * min(best.values())
    print(f"\n1. time to reward (10-step mean >= {target:.3f}, 90% of the lower best)")
    reached: dict[str, float] = {}
    for mode, r in rows.items():
        hit = time_to(r, target)
        total = r[-1]["time/unix_s"] - r[0]["time/unix_s"]
        final = _smoothed(r)[-1]
        where = "not reached" if hit is None else f"{hit[0]:6.1f}s at step {hit[1]:3d}"
        print(
            f"  {mode:5s}: {where};  {len(r)} steps in {total:.1f}s "
            f"({len(r) / total:.2f} steps/s), final 10-step reward {final:.3f}, "
            f"best {best[mode]:.3f}"
        )
        if hit is not None:
            reached[mode] = hit[0]
    if len(reached) == 2:
        print(f"  async speed-up to the target: {reached['sync'] / reached['async']:.2f}x")
    print("\n2. record latency, created_at_ms -> end of the trainer step that trained it")
    for mode in runs:
        lat = lat_by_mode[mode]
        print(
            f"  {mode:5s}: p50 {_percentile(lat, 0.5):.2f}s  p99 {_percentile(lat, 0.99):.2f}s"
            f"  ({len(lat)} records)"
        )
    print("\n3. version propagation, trainer 'published vN' -> producer 'applied vN'")
    for mode, run_dir in runs.items():
        prop = propagation(run_dir)
        if prop:
            print(
                f"  {mode:5s}: p50 {_percentile(prop, 0.5) * 1000:.0f}ms  "
                f"p99 {_percentile(prop, 0.99) * 1000:.0f}ms  ({len(prop)} versions)"
            )


if __name__ == "__main__":
    main()
