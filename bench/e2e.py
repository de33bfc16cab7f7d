"""End-to-end benchmark: async vs a fair sync baseline, against the overlap bound.

Run from the repository root: ``python -m bench.e2e [--steps N] [--seeds N] [--pin-cores]``.

For every seed, one embedded Kafka broker and one SeaweedFS store are started in a
temporary state directory per run; ``rollstream up`` then runs the whole pipeline
(engine, producer, stream worker, trainer as separate processes) ``--async`` and
``--sync`` with the same seed (model initialisation, prompts, sampling, trainer), the same
number of trainer steps and the same trust region: ``[trainer.ppo] minibatches`` (2 by
default) optimiser steps per scored batch, so the PPO clip acts in both modes. Both also
commit the stream's transactions every 0.2 s (``--commit-interval``): the trainer reads
only committed records, so a sync step waits for the next commit, and the shipped 1 s
interval made that wait most of a tiny-model sync step. Reported:

1. **Time to reward.** Per seed, the target is 90% of the lower of the two runs' best
   10-step mean reward, so both reach it; wall-clock from the first trained step
   (start-up is the same for both) and steps to reach it; the sync/async speed-up
   (median over seeds) and the final 10-step mean reward of each mode (mean ± sd).
2. **Busy time per trained step of each phase, and the overlap bound**, measured in the
   same runs while they go on (the roles' own counters, sampled every second past a
   warm-up): generation (the engine's ``busy_s`` from ``/get_server_info``), old logits
   (the stream's ``rollstream_streams_oldlogit_seconds_total``), training (the trainer's
   ``time/step_s`` + ``time/publish_s`` + ``time/checkpoint_s``). A sync step runs the
   phases one after the other; async can at best run them side by side, so the speed-up
   is bounded by sum / max of the phase times (**the overlap bound**), and on ``c``
   cores also by the cores: sum / max(max phase, sum / c); pinned, by the busiest core.
   Printed: each bound, the speed-up (to the reward, and in steps/s) as a fraction of
   it, the bottleneck phase, and wall time per step minus the busy sum (what a step spends
   in no phase: Kafka hops, the commit wait, weight propagation, contention). Beside
   them, CPU seconds per trained step of each role's process tree and of the whole
   machine (``/proc``: the broker and the store included), how many cores the run kept
   busy, the speed-up async's CPU per step would allow on the machine's cores, and the
   engine's tokens per trained step and per busy second.
3. **Record latency, produce -> trained**, p50/p99: ``created_at_ms`` (the producer's
   timestamp when the group's generation started, carried in every record) to the
   wall-clock time at the end of the trainer step that trained it (``time/unix_s`` of the
   step in the metrics file, joined through the trainer's ledger of trajectory ids).
4. **Version propagation, publish -> generator** (home region): the trainer's log line
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
import tomllib
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.figures import moving_mean, spread, trainer_rows
from core.config import merge_tables, to_toml
from rollstream.config.settings import load_config

MODES = ("async", "sync")
PHASES = ("generate", "old_logits", "train")
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?(published|applied) v(\d+)")
_OLDLOGIT_S = "rollstream_streams_oldlogit_seconds_total"
_INTERRUPTED = "rollstream_producer_interrupted_samples_total"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _smoothed(rows: list[dict[str, float]], window: int = 10) -> list[float]:
    return moving_mean([row["reward/mean"] for row in rows], window)


# --- busy time per phase -------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """The roles' cumulative busy seconds at one moment of a run, and the trainer's steps
    done by then."""

    step: int
    generate_s: float  # the engine's busy_s
    old_logits_s: float  # the stream's old-logit forward-pass seconds
    tokens: float = 0.0  # the engine's tokens_generated
    records: float = 0.0  # the producer's records acknowledged by Kafka
    interrupted: float = 0.0  # the producer's samples cut by a version change
    #: CPU seconds (user + system) of each role's process, and ``machine``: of every
    #: process on the machine's cores (the broker, the store and anything else included)
    cpu_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Phases:
    """Busy seconds per trained step of each phase."""

    generate: float
    old_logits: float
    train: float

    def values(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PHASES}

    @property
    def total(self) -> float:
        return sum(self.values().values())

    def bottleneck(self) -> str:
        values = self.values()
        return max(values, key=values.__getitem__)

    def overlap_bound(self) -> float:
        """The most asynchrony can gain over running the phases one after the other:
        sum / largest phase (each phase on its own core)."""
        return self.total / max(self.values().values())

    def bound_on_cores(self, cores: int) -> float:
        """The overlap bound when the phases share ``cores`` cores freely: no step can take
        less than the largest phase, nor less than the total work spread over the cores."""
        return self.total / max(max(self.values().values()), self.total / cores)

    def bound_pinned(self, groups: Sequence[Sequence[str]]) -> float:
        """The overlap bound when each group of phases shares one core (``--pin-cores``):
        the busiest core sets the pace."""
        values = self.values()
        return self.total / max(sum(values[name] for name in group) for group in groups)

    @classmethod
    def median(cls, many: Sequence[Phases]) -> Phases:
        return cls(*(statistics.median(getattr(p, name) for p in many) for name in PHASES))


def busy_per_step(
    samples: Sequence[Sample], rows: Sequence[Mapping[str, float]], warmup: int
) -> Phases | None:
    """Busy seconds per trained step of each phase between the first sample at or past
    ``warmup`` steps and the last one (start-up and the first steps left out); None when
    the run gave fewer than two such samples a step apart."""
    span = _span(samples, warmup)
    if span is None:
        return None
    first, last = span
    steps = last.step - first.step
    trained = [row for row in rows if first.step < row["step"] <= last.step]
    train = sum(
        row.get("time/step_s", 0.0) + row.get("time/publish_s", 0.0)
        + row.get("time/checkpoint_s", 0.0)
        for row in trained
    )  # fmt: skip
    return Phases(
        generate=(last.generate_s - first.generate_s) / steps,
        old_logits=(last.old_logits_s - first.old_logits_s) / steps,
        train=train / max(1, len(trained)),
    )


def _span(samples: Sequence[Sample], warmup: int) -> tuple[Sample, Sample] | None:
    """The first sample at or past ``warmup`` steps and the last, if a step apart."""
    usable = [s for s in samples if s.step >= warmup]
    if len(usable) < 2 or usable[-1].step <= usable[0].step:
        return None
    return usable[0], usable[-1]


def cpu_per_step(samples: Sequence[Sample], warmup: int) -> dict[str, float]:
    """CPU seconds per trained step of each process (``Sample.cpu_s``), each over the
    samples past ``warmup`` that saw it (a role that ended first, such as the trainer at
    its last step, counts up to then), and engine tokens per trained step (``tokens``)."""
    span = _span(samples, warmup)
    if span is None:
        return {}
    out: dict[str, float] = {}
    for name in {name for sample in samples for name in sample.cpu_s}:
        seen = [s for s in samples if s.step >= warmup and name in s.cpu_s]
        if len(seen) >= 2 and seen[-1].step > seen[0].step:
            spent = seen[-1].cpu_s[name] - seen[0].cpu_s[name]
            out[name] = spent / (seen[-1].step - seen[0].step)
    first, last = span
    steps = last.step - first.step
    out["tokens"] = (last.tokens - first.tokens) / steps
    out["records"] = (last.records - first.records) / steps
    out["interrupted"] = (last.interrupted - first.interrupted) / steps
    return out


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads), from ``/proc``."""
    found = _proc_stat(pid)
    return None if found is None else found[1]


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each named process and its live descendants (a role's supervisor
    starts its worker as a child); names whose process has ended are left out."""
    stats = {int(d.name): _proc_stat(int(d.name)) for d in Path("/proc").iterdir()
             if d.name.isdigit()}  # fmt: skip
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    out: dict[str, float] = {}
    for name, root in pids.items():
        if stats.get(root) is None:
            continue
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            stat = stats.get(pid)
            total += stat[1] if stat is not None else 0.0
            todo += children.get(pid, [])
        out[name] = total
    return out


def machine_cpu_s() -> float:
    """CPU seconds every process spent on this machine's cores (``/proc/stat``: all but
    idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _role_ports(run_dir: Path) -> tuple[int, int, int] | None:
    """The engine's, the stream worker's and the producer's metrics ports, once ``up``
    wrote the run's config."""
    try:
        data = tomllib.loads((run_dir / "rollstream.toml").read_text())
        return (
            int(data["producers"]["engine"]["port"]),
            int(data["streams"]["metrics_port"]),
            int(data["producers"]["rollout"]["metrics_port"]),
        )
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return None


def sample_roles(run_dir: Path, steps: int) -> Sample | None:
    """One ``Sample`` read from the running roles; None while one does not answer."""
    from rollstream.up.display import scrape

    ports = _role_ports(run_dir)
    if ports is None:
        return None
    engine, streams, producer = ports
    try:
        url = f"http://127.0.0.1:{engine}/get_server_info"
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            info = json.loads(answer.read())
        busy, tokens = float(info["busy_s"]), float(info["tokens_generated"])
        pids = json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError, KeyError):
        return None
    old_logits = scrape(streams, timeout_s=2.0).get(_OLDLOGIT_S)
    made = scrape(producer, timeout_s=2.0)
    records = made.get("rollstream_producer_trajectories_total")
    if old_logits is None or records is None:
        return None
    cut = sum(v for k, v in made.items() if k.startswith(_INTERRUPTED))
    cpu = {**tree_cpu_s(pids), "machine": machine_cpu_s()}
    return Sample(steps, busy, old_logits, tokens, records, cut, cpu)


# --- one run -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One ``rollstream up``: its mode, length, seed and the settings laid over the
    profile (the same for both modes of a comparison)."""

    mode: str
    steps: int
    seed: int
    pin: bool = False
    task: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    def config(self, state_dir: Path, run_dir: Path) -> dict[str, Any]:
        """The run's config file: the seed everywhere it matters, then ``settings``."""
        seeded = {
            "state_dir": str(state_dir),
            "profile": {
                "model": f"tiny:seed={self.seed}",
                **({"task": self.task} if self.task else {}),
            },
            "producers": {"engine": {"seed": self.seed}, "rollout": {"seed": self.seed}},
            "trainer": {
                "engine": {"seed": self.seed},
                "ledger_file": str(run_dir / "ledger.jsonl"),
            },
        }
        return merge_tables(seeded, dict(self.settings))


@dataclass
class Run:
    """A finished run: its directory and the busy-time samples taken while it ran."""

    spec: RunSpec
    run_dir: Path
    samples: list[Sample]
    seconds: float

    @property
    def rows(self) -> list[dict[str, float]]:
        return trainer_rows(self.run_dir)

    @property
    def warmup(self) -> int:
        return max(2, self.spec.steps // 10)

    def phases(self) -> Phases | None:
        return busy_per_step(self.samples, self.rows, self.warmup)

    def cpu(self) -> dict[str, float]:
        return cpu_per_step(self.samples, self.warmup)


def run_up(state_dir: Path, tmp: Path, spec: RunSpec, poll_s: float = 1.0) -> Run:
    """One ``rollstream up`` run on the running infra, its roles sampled every ``poll_s``."""
    from rollstream.up.display import TrainerLog

    run_id = f"bench-{spec.mode}-s{spec.seed}-{int(time.time())}"
    run_dir = state_dir / "runs" / run_id
    config = tmp / f"{run_id}.toml"
    config.write_text(to_toml(spec.config(state_dir, run_dir)))
    argv = [sys.executable, "-m", "rollstream", "--config", str(config), "up", f"--{spec.mode}"]
    argv += ["--max-steps", str(spec.steps), "--run-id", run_id, "--run-dir", str(run_dir)]
    argv += ["--pin-cores"] if spec.pin else []
    began = time.time()
    log = TrainerLog(run_dir / "trainer.jsonl")
    samples: list[Sample] = []
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        while process.poll() is None and time.time() - began < 3600:
            time.sleep(poll_s)
            log.poll()
            sample = sample_roles(run_dir, len(log.rows))
            if sample is not None:
                samples.append(sample)
        if process.poll() is None:
            process.terminate()
        out, err = process.communicate()
    seconds = time.time() - began
    print(f"  {spec.mode} seed {spec.seed}: {out.strip()} ({seconds:.0f}s)", flush=True)
    if process.returncode != 0:
        raise SystemExit(f"rollstream up --{spec.mode} failed:\n{err[-3000:]}")
    return Run(spec, run_dir, samples, seconds)


def with_infra(tmp: Path, spec: RunSpec, lat: dict[str, list[float]] | None = None) -> Run:
    """``spec`` on a fresh broker and store (no run sees another's data), stopped after;
    the run's record latencies are added to ``lat`` (read while its broker still runs)."""
    from infra.services import Services

    state = tmp / f"{spec.mode}-s{spec.seed}"
    services = Services(load_config(None, state_dir=state))
    print(f"{spec.mode} seed {spec.seed}: infra up in {services.up().seconds:.1f}s", flush=True)
    try:
        run = run_up(state, tmp, spec)
        if lat is not None:
            lat.setdefault(spec.mode, []).extend(
                latencies(run.run_dir, run.run_dir / "rollstream.toml", run.run_dir.name)
            )
        return run
    finally:
        services.down()


def time_to(rows: list[dict[str, float]], target: float) -> tuple[float, int] | None:
    """Seconds from the first step's end and steps until the 10-step mean reaches target."""
    start = rows[0]["time/unix_s"]
    for i, value in enumerate(_smoothed(rows)):
        if value >= target:
            return rows[i]["time/unix_s"] - start, i + 1
    return None


def steps_per_s(rows: list[dict[str, float]]) -> float:
    """Trained steps per second, first to last step."""
    span = rows[-1]["time/unix_s"] - rows[0]["time/unix_s"]
    return (len(rows) - 1) / span if span > 0 else 0.0


def latencies(run_dir: Path, config_path: Path, run_id: str) -> list[float]:
    """Seconds from each trained record's created_at_ms to the end of its trainer step."""
    from confluent_kafka import Consumer, TopicPartition

    from schemas.codec import decode

    step_end = {int(row["step"]): row["time/unix_s"] for row in trainer_rows(run_dir)}
    trained: dict[str, float] = {}
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        for tid in entry.get("trajectory_ids", ()):  # a guard's rollback line has none
            trained[tid] = step_end[int(entry["step"])]
    from infra.services import Services

    config = Services(load_config(config_path)).resolved()  # the embedded broker's address
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


def pin_groups(cores: int) -> list[list[str]]:
    """The phases sharing each core under ``--pin-cores`` (``rollstream.up.plan``'s core plan:
    engine and producer on the first cores, stream worker and trainer on the last)."""
    return [["generate"], ["old_logits", "train"]] if cores >= 2 else [list(PHASES)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="trainer steps per run")
    parser.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1, both modes each")
    parser.add_argument(
        "--minibatches", type=int, default=2, help="[trainer.ppo] minibatches, both modes"
    )
    parser.add_argument(
        "--commit-interval",
        type=float,
        default=0.2,
        help="[streams] commit_interval_s, both modes: a sync step waits for the stream's "
        "transaction to commit, so the shipped 1 s would be most of it",
    )
    parser.add_argument("--pin-cores", action="store_true", help="pin roles to cores")
    args = parser.parse_args()
    settings = {
        "trainer": {"ppo": {"minibatches": args.minibatches}},
        "streams": {"commit_interval_s": args.commit_interval},
    }
    cores = len(os.sched_getaffinity(0))
    print(
        f"{args.seeds} seeds x {MODES}, {args.steps} steps; in both modes [trainer.ppo] "
        f"minibatches = {args.minibatches}, [streams] commit_interval_s = "
        f"{args.commit_interval}; {cores} cores",
        flush=True,
    )
    runs: dict[int, dict[str, Run]] = {}
    lat: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-e2e-") as tmp:
        for seed in range(args.seeds):
            for mode in MODES:
                spec = RunSpec(mode, args.steps, seed, args.pin_cores, settings=settings)
                runs.setdefault(seed, {})[mode] = with_infra(Path(tmp), spec, lat)
        report(runs, lat, cores, args.pin_cores)


def report(
    runs: dict[int, dict[str, Run]], lat_by_mode: dict[str, list[float]], cores: int, pin: bool
) -> None:
    speedups, rates = _report_reward(runs)
    print("\n2. busy seconds per trained step (median over seeds; warm-up steps left out)")
    measured = {
        mode: [p for pair in runs.values() if (p := pair[mode].phases()) is not None]
        for mode in MODES
    }
    if not all(measured.values()):
        print("  not measured: too few samples of the roles' counters")
        return
    phases = {mode: Phases.median(found) for mode, found in measured.items()}
    wall = _report_phase_table(runs, phases)
    speedup, rate = _median_value(speedups), _median_value(rates)
    _report_bounds(phases, cores, pin, speedup, rate)
    neck = phases["async"].bottleneck()
    print(
        f"  bottleneck: {neck} ({phases['async'].values()[neck]:.3f}s of async's "
        f"{wall['async']:.3f}s wall per step)"
    )
    _report_cpu(runs, phases, wall, cores, rate)
    if pin and cores < len(PHASES) + 1:
        print(
            f"  note: {cores} cores cannot give each of the 4 roles its own core; --pin-cores "
            "puts engine and producer on the first, stream worker and trainer on the last"
        )
    _report_latency(runs, lat_by_mode)


def _report_reward(runs: dict[int, dict[str, Run]]) -> tuple[list[float], list[float]]:
    """Section 1: time to reward per seed; returns async's speed-ups to the target and in
    steps/s, one per seed (a seed where a mode missed the target has no speed-up)."""
    print("\n1. time to reward (per seed: 10-step mean >= 90% of the lower best of the pair)")
    speedups: list[float] = []
    rates: list[float] = []
    finals: dict[str, list[float]] = {mode: [] for mode in MODES}
    for seed, pair in runs.items():
        rows = {mode: run.rows for mode, run in pair.items()}
        target = 0.9 * min(max(_smoothed(r)) for r in rows.values())
        reached: dict[str, float] = {}
        for mode, r in rows.items():
            hit = time_to(r, target)
            finals[mode].append(_smoothed(r)[-1])
            where = "not reached" if hit is None else f"{hit[0]:6.1f}s at step {hit[1]:3d}"
            print(
                f"  seed {seed} {mode:5s}: {where} (target {target:.3f});  {len(r)} steps, "
                f"{steps_per_s(r):.2f} steps/s, final 10-step reward {_smoothed(r)[-1]:.3f}"
            )
            if hit is not None:
                reached[mode] = hit[0]
        if len(reached) == 2 and reached["async"] > 0:
            speedups.append(reached["sync"] / reached["async"])
        rates.append(steps_per_s(rows["async"]) / steps_per_s(rows["sync"]))
    print(
        f"  async speed-up to the target, sync/async wall-clock (median over seeds): "
        f"{_median(speedups)}x  {[round(x, 2) for x in speedups]}"
    )
    print(f"  async speed-up in steps/s (median): {_median(rates)}x")
    for mode in MODES:
        final = spread(finals[mode], digits=3)
        print(f"  final 10-step reward {mode:5s}: {final} (mean ± sd over seeds)")
    lower = statistics.fmean(finals["async"]) < statistics.fmean(finals["sync"])
    print(f"  target, async's final reward no lower than sync's: {'missed' if lower else 'met'}")
    return speedups, rates


def _report_phase_table(
    runs: dict[int, dict[str, Run]], phases: dict[str, Phases]
) -> dict[str, float]:
    """Section 2's table of busy seconds per phase and mode; returns each mode's median
    wall seconds per step."""
    print(f"  {'phase':12s} " + " ".join(f"{mode:>8s}" for mode in MODES))
    for name in PHASES:
        print(f"  {name:12s} " + " ".join(f"{phases[m].values()[name]:7.3f}s" for m in MODES))
    print(f"  {'sum':12s} " + " ".join(f"{phases[m].total:7.3f}s" for m in MODES))
    wall = {m: statistics.median(1 / steps_per_s(pair[m].rows) for pair in runs.values())
            for m in MODES}  # fmt: skip
    print(f"  {'wall/step':12s} " + " ".join(f"{wall[m]:7.3f}s" for m in MODES))
    print(f"  {'wall - sum':12s} " + " ".join(f"{wall[m] - phases[m].total:7.3f}s" for m in MODES))
    return wall


def _report_bounds(
    phases: dict[str, Phases], cores: int, pin: bool, speedup: float | None, rate: float | None
) -> None:
    """The speed-up bounds of the sync run's phases, and how much of each async achieved."""
    sync = phases["sync"]
    bounds = {
        "overlap bound, sum / max (a core per phase)": sync.overlap_bound(),
        f"on {cores} shared cores, sum / max(max, sum / {cores})": sync.bound_on_cores(cores),
    }
    if pin:
        groups = pin_groups(cores)
        bounds[f"pinned {groups}, sum / busiest core"] = sync.bound_pinned(groups)
    print("  bounds from the sync run's phases (async's phases give "
          f"{phases['async'].overlap_bound():.2f}x):")  # fmt: skip
    for name, bound in bounds.items():
        achieved = (
            f"wall-clock to reward {speedup / bound:.2f} of it, " if speedup is not None else ""
        )
        print(f"    {name}: {bound:.2f}x; achieved: {achieved}steps/s {rate / bound:.2f} of it")
    tightest = min(bounds.values())
    if speedup is not None:
        share = speedup / tightest
        print(
            f"  target, >= 0.90 of the tightest bound ({tightest:.2f}x) to the same reward: "
            f"{share:.2f}, {'met' if share >= 0.9 else 'missed'}"
        )


def _report_cpu(
    runs: dict[int, dict[str, Run]],
    phases: dict[str, Phases],
    wall: dict[str, float],
    cores: int,
    rate: float | None,
) -> None:
    """CPU seconds, engine tokens and records per trained step, from the roles' counters."""
    cpu = {m: [c for pair in runs.values() if (c := pair[m].cpu())] for m in MODES}
    names = sorted(
        {n for m in MODES for c in cpu[m] for n in c} - {"tokens", "records", "interrupted"}
    )
    print("  CPU seconds per trained step (user + system, median over seeds):")
    for name in names:
        print(f"    {name:10s} " + " ".join(f"{_median_of(cpu[m], name):7.3f}s" for m in MODES))
    print(
        "    cores busy (machine CPU s / wall s): "
        + ", ".join(f"{m} {_median_of(cpu[m], 'machine') / wall[m]:.2f}" for m in MODES)
    )
    machine = _median_of(cpu["async"], "machine")
    if machine == machine and rate is not None:  # not NaN
        floor = machine / cores
        print(
            f"  async's CPU on the machine ({machine:.3f}s a step over {cores} cores) allows at "
            f"best {floor:.3f}s a step: a speed-up of {wall['sync'] / floor:.2f}x over sync; "
            f"steps/s achieved {rate / (wall['sync'] / floor):.2f} of it"
        )
    print(
        "  engine tokens per trained step: "
        + ", ".join(f"{m} {_median_of(cpu[m], 'tokens'):.0f}" for m in MODES)
        + "; per busy second: "
        + ", ".join(f"{m} {_median_of(cpu[m], 'tokens') / phases[m].generate:.0f}" for m in MODES)
    )
    trained = {m: statistics.median(statistics.fmean(r.get("data/trajectories", 0.0)
                                                     for r in pair[m].rows)
                                     for pair in runs.values()) for m in MODES}  # fmt: skip
    print(
        "  records produced per trained step: "
        + ", ".join(f"{m} {_median_of(cpu[m], 'records'):.1f}" for m in MODES)
        + " (trained: "
        + ", ".join(f"{m} {trained[m]:.1f}" for m in MODES)
        + ")"
        + "; samples cut by a version change per step: "
        + ", ".join(f"{m} {_median_of(cpu[m], 'interrupted'):.1f}" for m in MODES)
    )


def _report_latency(runs: dict[int, dict[str, Run]], lat_by_mode: dict[str, list[float]]) -> None:
    """Sections 3 and 4: record latency and version propagation, p50 and p99 per mode."""
    print("\n3. record latency, created_at_ms -> end of the trainer step that trained it")
    for mode in MODES:
        lat = lat_by_mode.get(mode, [])
        if lat:
            print(
                f"  {mode:5s}: p50 {_percentile(lat, 0.5):.2f}s  "
                f"p99 {_percentile(lat, 0.99):.2f}s  ({len(lat)} records)"
            )
    print("\n4. version propagation, trainer 'published vN' -> producer 'applied vN'")
    for mode in MODES:
        prop = [x for pair in runs.values() for x in propagation(pair[mode].run_dir)]
        if prop:
            print(
                f"  {mode:5s}: p50 {_percentile(prop, 0.5) * 1000:.0f}ms  "
                f"p99 {_percentile(prop, 0.99) * 1000:.0f}ms  ({len(prop)} versions)"
            )


def _median_of(found: Sequence[Mapping[str, float]], key: str) -> float:
    values = [c[key] for c in found if key in c]
    return statistics.median(values) if values else float("nan")


def _median_value(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _median(values: Sequence[float]) -> str:
    value = _median_value(values)
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
