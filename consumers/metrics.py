"""Per-step metrics of the trainer: what they mean, and where they go.

Every trainer step (one scored batch) produces one flat dict of floats (namespaced names)
that goes to four sinks at once: a JSONL file (one object per step, flushed), Prometheus
gauges on a registry this object owns (no global state; served on ``prometheus_port`` if
set; one gauge per metric, see ``StepGauges``), the ``[tracking]`` backends
(``core.tracking``) and a rich progress line on stderr. Prometheus also has the run's role
instances by their heartbeats, ``rollstream_trainer_run_roles{role, state}``
(``core.presence``): how many producers, stream workers and trainers are active, left or
silent.

Data metrics (``data_metrics``), over the trajectories trained in the step:

==============================  ===============================================================
``reward/mean``, ``reward/std``  reward of the trained trajectories
``reward/<key>_frac``            share of them whose ``reward_details[key]`` is true, for
                                 every flag the task reports (``correct``, ``format_ok``)
``response/length_mean|max``     response tokens per trajectory
``prompt/length_mean``           prompt tokens per trajectory
``staleness/mean``               mean over policy tokens of (trainer version − the version
                                 of the segment that generated the token)
``staleness/max``                largest token staleness
``staleness/hist/<b>``           trajectories whose staleness (trainer version − oldest
                                 segment version) falls in bucket b: 0, 1, 2, 3, 4-7, 8-15, 16+
``staleness/region/<r>``         mean token staleness of region r's trajectories (version lag
                                 per region)
``data/groups``, ``data/trajectories``  trained in the step
``episode/turns_mean|max``       turns per trajectory (1 for a single-turn record)
``episode/policy_token_share``   policy tokens / response tokens (trained); ``env_token_share``
                                 the rest: environment tokens, conditioned on, not trained
``episode/tool_calls_mean``      tool calls per trajectory; ``tool_calls_total`` their sum
``episode/length_mean|max``      prompt + response tokens: the context an episode ended with
``episode/end/<reason>``         trajectories whose multi-turn episode ended for that reason
                                 (``done``, ``max_turns``, ``tool_timeout`` ...)
==============================  ===============================================================

Loss metrics come from ``consumers.losses`` (see its table): ``loss/total``,
``clip/frac``, ``mis/masked_frac``, ``nav/vetoed_frac``, ``veto/catastrophic_seqs``,
``ratio/*``, ``train_infer/kept_frac`` ..., plus ``mismatch/k3_kl`` (exact records only),
``grad/norm`` (before clipping, of the last optimiser step; ``grad/norm_max`` over the
step's optimiser steps), ``ppo/optimizer_steps``, ``optim/lr``, ``ewma/*``. The trainer
adds ``step``, ``version``, ``time/*`` (step, wait for data, publish, checkpoint seconds;
``time/unix_s`` the wall clock at the end of the step),
``throughput/tokens_per_s`` (prompt + response tokens of the step / step compute time),
``data/dlq`` (records sent to the DLQ since the last step) and, when it publishes,
``weights/forged_claims_total`` (manifests that did not verify, deleted off the slots of
its versions since it started: nonzero means someone else writes the bucket).

Stability guards (``consumers.guards``), every step whether a guard is on or not:
``guards/entropy`` (``policy/entropy``), ``guards/mismatch`` (k3 or mean |log d| of exact
records, as ``[trainer.guards.mismatch] metric`` says), ``guards/flat_frac`` (share of the
step's groups with zero reward variance), ``guards/flat_streak`` (consecutive batches with
all of them flat), ``guards/non_finite``, ``guards/paused``, ``guards/rollbacks``, and per
enabled guard ``guards/<name>/tripped`` (1 on a step it trips).

Backlog (``ScoredSource.lag``): ``lag/partition/<p>`` is the records of
``rollouts.scored[p]`` not trained yet (the consumer's last high watermark minus the
trained offset), ``lag/total`` their sum: a partition whose lag grows while the others'
shrink is starving.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, ClassVar

import numpy as np
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.presence import Presence
from core.prometheus import serve_registry
from core.tracking import Tracker
from schemas.control import ROLE_KINDS
from schemas.trajectory import Trajectory

log = logging.getLogger(__name__)

STALENESS_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2", 2, 2),
    ("3", 3, 3),
    ("4-7", 4, 7),
    ("8-15", 8, 15),
    ("16+", 16, None),
)


def staleness_bucket(staleness: int) -> str:
    for name, low, high in STALENESS_BUCKETS:
        if staleness >= low and (high is None or staleness <= high):
            return name
    return "0"  # negative staleness (a version from the future) counts as fresh


def data_metrics(trajectories: Sequence[Trajectory], version: int) -> dict[str, float]:
    """Reward, lengths and staleness of the trajectories trained at ``version``."""
    if not trajectories:
        return {"data/trajectories": 0.0}
    rewards = np.array([t.reward for t in trajectories], dtype=np.float64)
    resp = np.array([t.num_response_tokens for t in trajectories], dtype=np.float64)
    prompt = np.array([t.num_prompt_tokens for t in trajectories], dtype=np.float64)
    out: dict[str, float] = {
        "data/trajectories": float(len(trajectories)),
        "data/groups": float(len({t.group_id for t in trajectories})),
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "response/length_mean": float(resp.mean()),
        "response/length_max": float(resp.max()),
        "prompt/length_mean": float(prompt.mean()),
    }
    out.update(episode_metrics(trajectories))
    out.update(reward_flag_metrics(trajectories))
    out.update(reward_function_metrics(trajectories))
    for name, _, _ in STALENESS_BUCKETS:
        out[f"staleness/hist/{name}"] = 0.0
    token_staleness: list[np.ndarray] = []
    by_region: dict[str, list[np.ndarray]] = {}
    for traj in trajectories:
        if len(traj.segment_versions):
            oldest = version - int(traj.segment_versions.min())
            out[f"staleness/hist/{staleness_bucket(oldest)}"] += 1.0
        per_token = version - traj.token_versions()
        if traj.turn_kinds is not None:
            per_token = per_token[traj.loss_mask]  # staleness of what is trained
        token_staleness.append(per_token)
        by_region.setdefault(traj.region, []).append(per_token)
    all_tokens = np.concatenate(token_staleness) if token_staleness else np.empty(0)
    if all_tokens.size:
        out["staleness/mean"] = float(all_tokens.mean())
        out["staleness/max"] = float(all_tokens.max())
    for region, parts in by_region.items():
        joined = np.concatenate(parts)
        if joined.size:
            out[f"staleness/region/{region}"] = float(joined.mean())
    return out


#: At most this many flags per step: a task whose details carry per-record keys cannot
#: flood the metrics.
MAX_REWARD_FLAGS = 16


def reward_flag_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """What a reward is made of, per step: for each ``reward_details`` key whose value
    is a bool, the share of the trajectories carrying it where it is true."""
    seen: dict[str, list[bool]] = {}
    for traj in trajectories:
        for key, value in traj.reward_details.items():
            if isinstance(value, bool) and (key in seen or len(seen) < MAX_REWARD_FLAGS):
                seen.setdefault(key, []).append(value)
    return {f"reward/{key}_frac": sum(flags) / len(flags) for key, flags in seen.items()}


def reward_function_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Each reward function's mean value per step (``reward/fn/<name>``), over the
    trajectories it gave a value for, and the share of trajectories it failed on
    (``reward/fn_failed/<name>``: raised, timed out or returned no number), from the
    ``rewards`` and ``reward_errors`` a task's reward functions record per sample
    (``producers.tasks.rewards``)."""
    seen: dict[str, list[float]] = {}
    failed: dict[str, list[bool]] = {}
    for traj in trajectories:
        values = traj.reward_details.get("rewards")
        if not isinstance(values, dict):
            continue
        errors = traj.reward_details.get("reward_errors")
        for name, value in values.items():
            if name not in seen and len(seen) >= MAX_REWARD_FLAGS:
                continue
            numbers = seen.setdefault(str(name), [])
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers.append(float(value))
            failed.setdefault(str(name), []).append(isinstance(errors, dict) and name in errors)
    out = {f"reward/fn/{name}": float(np.mean(v)) for name, v in seen.items() if v}
    out.update({f"reward/fn_failed/{name}": float(np.mean(v)) for name, v in failed.items()})
    return out


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Turns, policy/environment token shares, tool calls, lengths and end reasons."""
    turns = np.array([t.num_turns for t in trajectories], dtype=np.float64)
    policy = sum(t.num_policy_tokens for t in trajectories)
    response = sum(t.num_response_tokens for t in trajectories)
    tools = np.array([t.tool_calls for t in trajectories], dtype=np.float64)
    length = np.array(
        [t.num_prompt_tokens + t.num_response_tokens for t in trajectories], dtype=np.float64
    )
    out = {
        "episode/turns_mean": float(turns.mean()),
        "episode/turns_max": float(turns.max()),
        "episode/policy_token_share": policy / response if response else 1.0,
        "episode/env_token_share": (response - policy) / response if response else 0.0,
        "episode/tool_calls_mean": float(tools.mean()),
        "episode/tool_calls_total": float(tools.sum()),
        "episode/length_mean": float(length.mean()),
        "episode/length_max": float(length.max()),
    }
    for traj in trajectories:
        if traj.episode_end:
            key = f"episode/end/{traj.episode_end}"
            out[key] = out.get(key, 0.0) + 1.0
    return out


class StepGauges:
    """One Prometheus gauge per step metric, named by convention: ``reward/mean`` is
    ``rollstream_trainer_reward_mean``. The families whose last part is data (a partition,
    a region, a staleness bucket, an episode's end) are one gauge with that part as a
    label: ``rollstream_trainer_lag_partition{partition="3"}``."""

    LABELLED: ClassVar[dict[str, str]] = {
        "lag/partition/": "partition",
        "staleness/region/": "region",
        "staleness/hist/": "bucket",
        "episode/end/": "reason",
    }

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._gauges: dict[str, Gauge] = {}

    @staticmethod
    def prometheus_name(metric: str) -> str:
        return "rollstream_trainer_" + re.sub(r"[^a-zA-Z0-9_]", "_", metric)

    def set(self, metric: str, value: float) -> None:
        for prefix, label in self.LABELLED.items():
            if metric.startswith(prefix):
                gauge = self._gauge(prefix.rstrip("/"), (label,))
                gauge.labels(metric[len(prefix) :]).set(value)
                return
        self._gauge(metric, ()).set(value)

    def _gauge(self, metric: str, labels: tuple[str, ...]) -> Gauge:
        name = self.prometheus_name(metric)
        if name not in self._gauges:
            self._gauges[name] = Gauge(
                name, f"Trainer step metric {metric} (consumers.metrics).", labels,
                registry=self.registry,
            )  # fmt: skip
        return self._gauges[name]


class MetricsSink:
    """JSONL file + Prometheus registry + optional rich progress line."""

    def __init__(
        self,
        metrics_file: Path | None,
        *,
        registry: CollectorRegistry | None = None,
        progress: bool = False,
        total_steps: int | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._file: IO[bytes] | None = None
        if metrics_file is not None:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            self._file = metrics_file.open("ab")
        self._gauges = StepGauges(self.registry)
        self._tracker = tracker if tracker is not None else Tracker([])
        self.steps = Counter(
            "rollstream_trainer_steps", "Optimiser steps taken.", registry=self.registry
        )
        self.trajectories = Counter(
            "rollstream_trainer_trajectories",
            "Trajectories trained.",
            registry=self.registry,
        )
        self.tokens = Counter(
            "rollstream_trainer_tokens", "Prompt + response tokens trained.", registry=self.registry
        )
        self.dlq = Counter(
            "rollstream_trainer_dlq_records",
            "Records sent to the DLQ.",
            ["reason"],
            registry=self.registry,
        )
        self.run_roles = Gauge(
            "rollstream_trainer_run_roles",
            "Role instances in the run by their heartbeats (core.presence): active, left, silent.",
            ["role", "state"],
            registry=self.registry,
        )
        self.staleness = Histogram(
            "rollstream_trainer_staleness",
            "Trajectory staleness (trainer version - oldest segment version).",
            buckets=(0, 1, 2, 3, 7, 15, math.inf),
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None
        self._total_steps = total_steps
        self._plain = False  # progress as log lines: stderr is a file, not a terminal
        if progress:
            from rich.console import Console

            console = Console(stderr=True)
            self._plain = not console.is_terminal
        if progress and not self._plain:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("waiting for data", total=total_steps)

    def record_roles(self, presence: Presence) -> None:
        """How many producers, stream workers and trainers the run has, by state."""
        for role in ROLE_KINDS:
            for state, beats in (
                ("active", presence.active),
                ("left", presence.left),
                ("silent", presence.silent),
            ):
                count = sum(beat.role == role for beat in beats)
                self.run_roles.labels(role=role, state=state).set(count)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose the registry over HTTP on ``host`` (loopback unless asked); returns the
        bound port."""
        return serve_registry(self.registry, port, host)

    def record_dlq(self, reason: str) -> None:
        self.dlq.labels(reason=reason).inc()

    def emit(self, metrics: dict[str, float], trajectories: Sequence[Trajectory] = ()) -> None:
        """Write one step's metrics everywhere."""
        with self._lock:
            clean = {k: v for k, v in metrics.items() if math.isfinite(v)}
            if self._file is not None:
                self._file.write(orjson.dumps(clean) + b"\n")
                self._file.flush()
            for name, value in clean.items():
                self._gauges.set(name, value)
            self._tracker.log(clean, int(metrics.get("step", 0)))
            self.steps.inc()
            self.trajectories.inc(len(trajectories))
            self.tokens.inc(sum(t.num_prompt_tokens + t.num_response_tokens for t in trajectories))
            version = int(metrics.get("version", 0))
            for traj in trajectories:
                if len(traj.segment_versions):
                    self.staleness.observe(version - int(traj.segment_versions.min()))
            if self._progress is not None:
                self._progress.update(
                    self._task,
                    completed=int(metrics.get("step", 0)),
                    description=progress_line(clean),
                )
            elif self._plain:  # a log file: the whole line, not a bar cut to 80 columns
                total = "" if self._total_steps is None else f"/{self._total_steps}"
                log.info(
                    "train step %d%s  %s", int(metrics.get("step", 0)), total, progress_line(clean)
                )

    def close(self) -> None:
        self._tracker.close()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None


def progress_line(metrics: dict[str, float]) -> str:
    """The short summary shown next to the progress bar."""
    parts = []
    for name, label, fmt in (
        ("version", "v", "{:.0f}"),
        ("loss/total", "loss", "{:+.4f}"),
        ("reward/mean", "reward", "{:.3f}"),
        ("staleness/mean", "stale", "{:.2f}"),
        ("clip/frac", "clip", "{:.3f}"),
        ("grad/norm", "|g|", "{:.3f}"),
        ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
    ):
        if name in metrics:
            parts.append(f"{label} {fmt.format(metrics[name])}")
    return "  ".join(parts)
