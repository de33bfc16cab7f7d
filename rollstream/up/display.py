"""What ``rollstream up`` shows while its roles run: per policy a row for its stream
workers, trainer, engines and producers, refreshed from the trainer's metrics JSONL and
the roles' Prometheus endpoints, with the instances their heartbeats count. A run without
``[policies]`` shows its one policy's rows under the plain role names."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.config.settings import RollstreamConfig
from rollstream.up.plan import PolicyPlan, policy_views

ROLE_ORDER = ("streams", "trainer", "engine", "producer", "eval")


def scrape(port: int, timeout_s: float = 1.0) -> dict[str, float]:
    """Prometheus samples of a role, ``name{label="v"}`` -> value (empty if unreachable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


@dataclass
class TrainerLog:
    """Reads the trainer's metrics JSONL as it grows (whole lines only)."""

    path: Path
    rows: list[dict[str, float]] = field(default_factory=list)
    _offset: int = 0

    def poll(self) -> list[dict[str, float]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.rows.extend(new)
        return new

    def mean(self, key: str, last: int) -> float | None:
        values = [row[key] for row in self.rows[-last:] if key in row]
        return sum(values) / len(values) if values else None

    def summary(self) -> dict[str, Any]:
        """Steps, the mean reward of the first and last 10 steps, and each reward
        function's share of failed samples over the run."""
        rewards = [row["reward/mean"] for row in self.rows if "reward/mean" in row]
        return {
            "steps": len(self.rows),
            "reward_first": sum(rewards[:10]) / len(rewards[:10]) if rewards else None,
            "reward_last": sum(rewards[-10:]) / len(rewards[-10:]) if rewards else None,
            "reward_failures": self.reward_failures(),
        }

    def reward_failures(self, last: int | None = None) -> dict[str, float]:
        """Each reward function's mean share of failed samples over the last ``last``
        steps (all when None)."""
        rows = self.rows[-last:] if last else self.rows
        names = {k.removeprefix(FAILED) for row in rows for k in row if k.startswith(FAILED)}
        return {
            name: mean
            for name in sorted(names)
            if (mean := self.mean(FAILED + name, len(rows))) is not None
        }

    def always_failing(self, steps: int) -> list[str]:
        """Reward functions that failed on every sample of each of the last ``steps``
        steps (none until there are that many)."""
        rows = self.rows[-steps:]
        if steps < 1 or len(rows) < steps:
            return []
        names = {k.removeprefix(FAILED) for k in rows[-1] if k.startswith(FAILED)}
        return sorted(n for n in names if all(row.get(FAILED + n) == 1.0 for row in rows))


FAILED = "reward/fn_failed/"
"""Trainer metric prefix: a reward function's share of failed samples in a step."""


@dataclass
class RewardWatch:
    """A reward function that fails on every sample, step after step, trains nothing:
    ``check`` says so once per function (``ends_run``: the supervisor stops the run)."""

    logs: Mapping[str, TrainerLog]
    steps: int
    ends_run: bool
    _told: set[tuple[str, str]] = field(default_factory=set)

    def check(self) -> str | None:
        for policy, log in self.logs.items():
            for name in log.always_failing(self.steps):
                if (policy, name) not in self._told:
                    self._told.add((policy, name))
                    where = f" (policy {policy})" if policy else ""
                    return (
                        f"reward function {name}{where} failed on every sample for "
                        f"{self.steps} steps: see the producer log for why"
                    )
        return None


class Rate:
    """Per-second rate of a counter between two reads."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None
        self.value = 0.0

    def update(self, total: float | None) -> float:
        if total is None:
            return self.value
        now = time.monotonic()
        if self._last is not None and now - self._last[0] >= 1.0:
            self.value = (total - self._last[1]) / (now - self._last[0])
            self._last = (now, total)
        elif self._last is None:
            self._last = (now, total)
        return self.value


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _merged(scrapes: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Samples of several processes of one kind, added up (versions: the highest)."""
    merged: dict[str, float] = {}
    for samples in scrapes:
        for name, value in samples.items():
            if name.endswith("_version") or name.endswith("_paused"):
                merged[name] = max(merged.get(name, value), value)
            else:
                merged[name] = merged.get(name, 0.0) + value
    return merged


def _instances(alive: Mapping[str, str], role: str) -> list[str]:
    """The processes of one row: ``streams``, ``streams-1``, ... for ``streams``."""
    return [
        name
        for name in alive
        if name == role or (name.startswith(role + "-") and name[len(role) + 1 :].isdigit())
    ]


def _running(alive: Mapping[str, str], role: str) -> str:
    """``2/2 up``: how many processes of one row are running."""
    mine = [alive[name] for name in _instances(alive, role)]
    return f"{sum(state.startswith('pid') for state in mine)}/{len(mine)} up"


def _sum(samples: Mapping[str, float], prefix: str) -> float | None:
    found = [v for k, v in samples.items() if k == prefix or k.startswith(prefix + "{")]
    return sum(found) if found else None


def _label(sample: str) -> str:
    """The value of a one-label sample name: ``name{policy="solver"}`` -> ``solver``."""
    return sample.partition('="')[2].rstrip('"}')


def _role_table(title: str, rows: list[tuple[str, str, str]]) -> Any:
    """The live display: a rich table of (role, process, progress) rows."""
    from rich.table import Table

    table = Table(title=title, expand=False)
    for column in ("role", "process", "progress"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def eval_logs(config: RollstreamConfig) -> dict[str, TrainerLog]:
    """Each evaluated policy's eval metrics file (``eval.jsonl``, ``eval.<policy>.jsonl``)."""
    return {
        name: TrainerLog(Path(str(view.producers.eval.metrics_file)))
        for name, view in policy_views(config).items()
        if view.producers.eval.every_versions and view.producers.eval.metrics_file
    }


def trainer_logs(config: RollstreamConfig) -> dict[str, TrainerLog]:
    """Each policy's trainer metrics file (``trainer.jsonl``, ``trainer.<policy>.jsonl``)."""
    return {
        name: TrainerLog(Path(str(view.trainer.metrics_file)))
        for name, view in policy_views(config).items()
    }


@dataclass
class _Rates:
    """One policy's per-second rates (counters between two reads)."""

    producer_groups: Rate = field(default_factory=Rate)
    producer_tokens: Rate = field(default_factory=Rate)
    streams_in: Rate = field(default_factory=Rate)


class Dashboard:
    """Per policy one row per kind of role (a peer policy has no engine or producer: its
    records come from the producers that call it), refreshed from the trainer log and the
    roles' endpoints."""

    def __init__(
        self,
        config: RollstreamConfig,
        plan: Sequence[PolicyPlan],
        logs: Mapping[str, TrainerLog],
        roles: Mapping[str, Any] | None = None,
        evals: Mapping[str, TrainerLog] | None = None,
    ) -> None:
        self.config = config
        self.plan = plan
        self.logs = logs
        self.roles = roles or {}  # per policy, a core.presence.Poller of run_roles
        self.started = time.monotonic()
        self.rates = {policy.name: _Rates() for policy in plan}
        self.evals = evals or {}  # per evaluated policy, its eval rows (``eval_logs``)

    def rows(self, alive: Mapping[str, str]) -> list[tuple[str, str, str]]:
        """(role, state, figures) rows; processes no row counts come last, bare."""
        rows = [row for policy in self.plan for row in self._policy_rows(policy, alive)]
        shown = {name for role, _, _ in rows for name in _instances(alive, role)}
        rows += [(name, alive[name], "") for name in sorted(alive) if name not in shown]
        return rows

    def _policy_rows(
        self, policy: PolicyPlan, alive: Mapping[str, str]
    ) -> list[tuple[str, str, str]]:
        view, ports, rates = policy.config, policy.ports, self.rates[policy.name]
        log = self.logs[policy.name]
        log.poll()
        last = log.rows[-1] if log.rows else {}
        steps = len(log.rows)
        elapsed = time.monotonic() - self.started
        poller = self.roles.get(policy.name)
        found = poller.latest if poller is not None else None
        figures = {
            "trainer": (
                f"step {int(last.get('step', 0))}/{view.trainer.max_steps}  "
                f"v{int(last.get('version', 0))}  reward {fmt(last.get('reward/mean'))} "
                f"(last 10: {fmt(log.mean('reward/mean', 10))})  "
                f"staleness {fmt(last.get('staleness/mean'), '.2f')}  "
                f"{fmt(last.get('throughput/tokens_per_s'), '.0f')} tok/s  "
                f"{steps / elapsed if elapsed > 0 else 0:.2f} steps/s"
                + "".join(
                    f"  {name} failed {share:.0%}"
                    for name, share in log.reward_failures(10).items()
                    if share > 0
                )
            )
        }
        s = _merged(scrape(port) for port in ports.all_streams_metrics)
        records = s.get(f'rollstream_streams_records_in_total{{topic="{view.streams.topics.raw}"}}')
        figures["streams"] = (
            f"{_running(alive, policy.role('streams'))}  "
            f"trainer v{fmt(s.get('rollstream_streams_trainer_version'), '.0f')}  "
            f"records {fmt(records, '.0f')} ({rates.streams_in.update(records):.1f}/s)  "
            f"groups {fmt(_sum(s, 'rollstream_streams_groups_total'), '.0f')}  "
            f"stale {fmt(s.get('rollstream_streams_stale_total'), '.0f')}  "
            f"dlq {fmt(_sum(s, 'rollstream_streams_dlq_total'), '.0f')}"
        )
        if policy.drives:
            figures["engine"] = f"{_running(alive, policy.role('engine'))}  " + "  ".join(
                f"http://127.0.0.1:{port}" for port in ports.engines
            )
            p = _merged(scrape(port) for port in ports.all_producer_metrics)
            groups = p.get("rollstream_producer_groups_total")
            tokens = p.get("rollstream_producer_tokens_total")
            peers = ", ".join(
                f"{_label(key)} {value:.0f}"
                for key, value in p.items()
                if key.startswith("rollstream_producer_peer_samples_total{")
            )
            figures["producer"] = (
                f"{_running(alive, policy.role('producer'))}  "
                f"v{fmt(p.get('rollstream_producer_version'), '.0f')}  "
                f"groups {fmt(groups, '.0f')} ({rates.producer_groups.update(groups):.1f}/s)  "
                f"{rates.producer_tokens.update(tokens):.0f} tok/s  "
                f"paused {fmt(p.get('rollstream_producer_admission_paused'), '.0f')}"
                + (f"  peer samples: {peers}" if peers else "")
            )
        evaluated = self.evals.get(policy.name)
        if evaluated is not None and policy.drives:
            evaluated.poll()
            latest = evaluated.rows[-1] if evaluated.rows else {}
            figures["eval"] = (
                f"{_running(alive, policy.role('eval'))}  "
                f"every {view.producers.eval.every_versions} versions  "
                f"last v{fmt(latest.get('version'), '.0f')}  "
                f"reward {fmt(latest.get('eval/reward/mean'))}"
            )
        if found is not None:  # instances joined by hand count too
            for kind in ("producer", "streams", "trainer"):
                if kind in figures:
                    figures[kind] += f"  in run: {found.summary(kind)}"
                    if kind == "streams":
                        figures[kind] += f"  lag {found.lag_line() or '-'}"
        return [
            (policy.role(kind), alive.get(policy.role(kind), "-"), figures[kind])
            for kind in ROLE_ORDER
            if kind in figures
        ]

    def table(self, alive: Mapping[str, str]) -> Any:
        mode = "sync" if self.config.profile.sync else "async"
        names = [policy.name for policy in self.plan if policy.name]
        return _role_table(
            f"rollstream up: run {self.config.run_id} ({mode}), "
            + (f"policies {', '.join(names)}, " if names else "")
            + f"{time.monotonic() - self.started:.0f}s",
            self.rows(alive),
        )

    def line(self, alive: Mapping[str, str]) -> str:
        return " | ".join(f"{name} {figures}" for name, _, figures in self.rows(alive) if figures)
