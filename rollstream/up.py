"""``rollstream up``: the whole pipeline on one machine, as separate processes.

1. Take the loaded config (its ``[profile]``'s settings under whatever the file sets,
   as every role gets them; ``--model``, ``--sync`` ... change the profile) and add what
   ``up`` itself needs: free ports, files in the run dir, per-run group ids.
2. Start embedded Kafka and S3 unless the config points to external ones; declare topics.
3. Write the merged config to ``<run_dir>/rollstream.toml`` (mode 0600: it can hold
   credentials). Embedded services stay embedded in it: each role finds them through the
   state dir, so the file also serves ``infra up``, ``audit`` and ``replay`` after the run.
4. Start the commands a user would run on separate machines, each with
   ``--config <run_dir>/rollstream.toml`` and its log in ``<run_dir>/logs``:
   ``rollstream stream``, ``rollstream train``, ``rollstream serve``, then
   ``rollstream produce --engine-url ...`` once the others are ready.
5. Show live progress (trainer metrics JSONL, Prometheus endpoints of the other roles)
   until the trainer reaches ``max_steps``; Ctrl-C or SIGTERM stops early. Either way
   every role is stopped (SIGTERM, SIGKILL after a timeout) and embedded services that
   this command started are stopped too.

Sync and async differ only in config (``[profile] sync``): sync sets the producers'
staleness window and the streams' ``max_staleness`` to 0, and the producers' admission
credit (``groups_per_version``) lets generation start one step's groups per published
version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import click
from pydantic import BaseModel, ValidationError

from core.config import merge_tables, to_toml
from rollstream.config import RollstreamConfig, UpConfig
from rollstream.profiles import ProfileConfig, profile_sections

ROLE_ORDER = ("streams", "trainer", "engine", "producer")
STOP_ORDER = ("producer", "engine", "streams", "trainer")


# --- config ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ports:
    """Loopback ports of the roles' HTTP endpoints, chosen free by ``up``. The first
    engine, producer and stream worker take theirs from the run's config; further ones
    (``--producers``, ``--stream-workers``) get theirs on their command line."""

    engine: int
    producer_metrics: int
    streams_metrics: int
    trainer_metrics: int
    more_engines: tuple[int, ...] = ()
    more_producer_metrics: tuple[int, ...] = ()
    more_streams_metrics: tuple[int, ...] = ()

    @classmethod
    def free(cls) -> Ports:
        from core.process import free_port

        return cls(free_port(), free_port(), free_port(), free_port())

    def with_more(self, producers: int, stream_workers: int) -> Ports:
        """These ports plus free ones for the producers and stream workers past the first."""
        from core.process import free_port

        extra = producers - 1
        return dataclasses.replace(
            self,
            more_engines=tuple(free_port() for _ in range(extra)),
            more_producer_metrics=tuple(free_port() for _ in range(extra)),
            more_streams_metrics=tuple(free_port() for _ in range(stream_workers - 1)),
        )

    @property
    def engines(self) -> tuple[int, ...]:
        return (self.engine, *self.more_engines)

    @property
    def all_producer_metrics(self) -> tuple[int, ...]:
        return (self.producer_metrics, *self.more_producer_metrics)

    @property
    def all_streams_metrics(self) -> tuple[int, ...]:
        return (self.streams_metrics, *self.more_streams_metrics)

    @classmethod
    def of(cls, config: RollstreamConfig) -> Ports:
        """The ports a merged config ended up with (a file may have set its own)."""
        found = (
            config.producers.engine.port,
            config.producers.rollout.metrics_port,
            config.streams.metrics_port,
            config.trainer.prometheus_port,
        )
        if not all(found):
            raise click.UsageError("rollstream up needs every role's port (none may be 0)")
        return cls(*(int(port) for port in found))  # type: ignore[arg-type]


def up_sections(up: UpConfig, run_id: str, run_dir: Path, ports: Ports) -> dict[str, Any]:
    """What ``up`` itself sets unless the file says otherwise: ports, files in the run
    dir, per-run group ids, quiet roles. What the roles learn with comes from the
    ``[profile]`` (``rollstream.profiles``), already in the loaded config."""
    return {
        "run_id": run_id,
        "producers": {
            "engine": {"port": ports.engine},
            "rollout": {
                "producer_id": f"{run_id}-producer-0",
                "metrics_port": ports.producer_metrics,
                "progress": False,
            },
        },
        "streams": {
            "app_id": f"rollstream-streams-{run_id}",
            "metrics_port": ports.streams_metrics,
            "first_start": "committed",  # a new run starts at the end of rollouts.raw
        },
        "trainer": {
            "max_steps": up.max_steps,
            "metrics_file": str(run_dir / "trainer.jsonl"),
            "ledger_file": str(run_dir / "ledger.jsonl"),  # for `rollstream audit`
            "prometheus_port": ports.trainer_metrics,
            "progress": False,
            "checkpoint": {"every": 50, "dir": str(run_dir / "checkpoints")},
            "topics": {
                "group_id": f"rollstream-trainer-{run_id}",
                "group_instance_id": f"rollstream-trainer-{run_id}-0",
            },
        },
    }


def explicit_values(config: BaseModel) -> dict[str, Any]:
    """The values a config file or the environment set (defaults left out), recursively."""
    return config.model_dump(exclude_unset=True)


def build_config(
    base: RollstreamConfig, up: UpConfig, run_id: str, run_dir: Path, ports: Ports
) -> RollstreamConfig:
    """``up_sections`` under the explicit values of ``base`` (its profile's settings
    included); ``up`` replaces ``[up]``."""
    explicit = explicit_values(base)
    explicit.pop("up", None)
    explicit.pop("run_id", None)
    merged = merge_tables(up_sections(up, run_id, run_dir, ports), explicit)
    merged["up"] = up.model_dump()
    merged["trainer"]["max_steps"] = up.max_steps  # [up] max_steps (or --max-steps) decides
    if merged.get("policies"):
        merged["policies"] = {
            name: merge_tables(policy_ports(), with_own_profile(base, table))
            for name, table in merged["policies"].items()
        }
    return RollstreamConfig.model_validate(merged)


def with_own_profile(base: RollstreamConfig, table: dict[str, Any]) -> dict[str, Any]:
    """A policy's table with what its own ``[profile]`` derives laid under it. The run's
    file holds the root profile's settings as explicit values, which a policy's profile
    would otherwise lose to (``load_config`` applies a policy's profile before them)."""
    if "profile" not in table:
        return table
    own = merge_tables(base.profile.model_dump(exclude_unset=True), table["profile"])
    return merge_tables(profile_sections(ProfileConfig.model_validate(own)), table)


def policy_ports() -> dict[str, Any]:
    """Free ports for one policy's roles under ``up`` (each policy has its own)."""
    from core.process import free_port

    return {
        "producers": {
            "engine": {"port": free_port()},
            "rollout": {"metrics_port": free_port()},
        },
        "streams": {"metrics_port": free_port()},
        "trainer": {"prometheus_port": free_port()},
    }


def driving_policies(config: RollstreamConfig) -> list[str]:
    """The policies that get producers: every policy no other policy calls as a peer
    (a peer's records come from the producers of the policies that call it)."""
    views = {name: config.view(name) for name in sorted(config.policies)}
    called = {peer for view in views.values() for peer in view.producers.rollout.peers}
    return [name for name in views if name not in called]


def write_config(config: RollstreamConfig, path: Path) -> None:
    """Write ``config`` as TOML and prove it reads back identical (every role reads it).

    The file can hold credentials (SASL, S3), so only its owner may read it (0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        fh.write(to_toml(config.model_dump(mode="python")))
    with path.open("rb") as fh:
        again = RollstreamConfig.model_validate(tomllib.load(fh))
    if again != config:
        raise ValueError(
            f"{path} does not read back as the config it was written from "
            "(a value TOML cannot hold, such as an explicit empty optional)"
        )


# --- progress sources --------------------------------------------------------------------


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
        """Steps and the mean reward of the first and last 10 steps."""
        rewards = [row["reward/mean"] for row in self.rows if "reward/mean" in row]
        return {
            "steps": len(self.rows),
            "reward_first": sum(rewards[:10]) / len(rewards[:10]) if rewards else None,
            "reward_last": sum(rewards[-10:]) / len(rewards[-10:]) if rewards else None,
        }


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


def _fmt(value: float | None, spec: str = ".3f") -> str:
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


def _running(alive: Mapping[str, str], kind: str) -> str:
    """``2/2 up``: how many processes of one kind are running."""
    mine = [state for name, state in alive.items() if name.split("-")[0] == kind]
    return f"{sum(state.startswith('pid') for state in mine)}/{len(mine)} up"


def _sum(samples: Mapping[str, float], prefix: str) -> float | None:
    found = [v for k, v in samples.items() if k == prefix or k.startswith(prefix + "{")]
    return sum(found) if found else None


class Dashboard:
    """One line per role, refreshed from the trainer log and the roles' endpoints."""

    def __init__(
        self, config: RollstreamConfig, ports: Ports, log: TrainerLog, roles: Any = None
    ) -> None:
        self.config = config
        self.ports = ports
        self.log = log
        self.roles = roles  # a core.presence.Poller of rollstream.roles.run_roles
        self.started = time.monotonic()
        self.producer_groups = Rate()
        self.producer_tokens = Rate()
        self.streams_in = Rate()

    def rows(self, alive: Mapping[str, str]) -> list[tuple[str, str, str]]:
        """(role, state, figures) rows."""
        self.log.poll()
        last = self.log.rows[-1] if self.log.rows else {}
        steps = len(self.log.rows)
        elapsed = time.monotonic() - self.started
        trainer = (
            f"step {int(last.get('step', 0))}/{self.config.trainer.max_steps}  "
            f"v{int(last.get('version', 0))}  reward {_fmt(last.get('reward/mean'))} "
            f"(last 10: {_fmt(self.log.mean('reward/mean', 10))})  "
            f"staleness {_fmt(last.get('staleness/mean'), '.2f')}  "
            f"{_fmt(last.get('throughput/tokens_per_s'), '.0f')} tok/s  "
            f"{steps / elapsed if elapsed > 0 else 0:.2f} steps/s"
        )
        p = _merged(scrape(port) for port in self.ports.all_producer_metrics)
        groups = p.get("rollstream_producer_groups_total")
        producer = (
            f"{_running(alive, 'producer')}  v{_fmt(p.get('rollstream_producer_version'), '.0f')}  "
            f"groups {_fmt(groups, '.0f')} ({self.producer_groups.update(groups):.1f}/s)  "
            f"{self.producer_tokens.update(p.get('rollstream_producer_tokens_total')):.0f} tok/s  "
            f"paused {_fmt(p.get('rollstream_producer_admission_paused'), '.0f')}"
        )
        s = _merged(scrape(port) for port in self.ports.all_streams_metrics)
        records = s.get('rollstream_streams_records_in_total{topic="rollouts.raw"}')
        streams = (
            f"{_running(alive, 'streams')}  "
            f"trainer v{_fmt(s.get('rollstream_streams_trainer_version'), '.0f')}  "
            f"records {_fmt(records, '.0f')} ({self.streams_in.update(records):.1f}/s)  "
            f"groups {_fmt(_sum(s, 'rollstream_streams_groups_total'), '.0f')}  "
            f"stale {_fmt(s.get('rollstream_streams_stale_total'), '.0f')}  "
            f"dlq {_fmt(_sum(s, 'rollstream_streams_dlq_total'), '.0f')}"
        )
        engine = f"{_running(alive, 'engine')}  " + "  ".join(
            f"http://127.0.0.1:{port}" for port in self.ports.engines
        )
        found = self.roles.latest if self.roles is not None else None
        if found is not None:  # instances joined by hand count too
            producer += f"  in run: {found.summary('producer')}"
            streams += f"  in run: {found.summary('streams')}  lag {found.lag_line() or '-'}"
            trainer += f"  in run: {found.summary('trainer')}"
        figures = {"trainer": trainer, "producer": producer, "streams": streams, "engine": engine}
        state = {kind: alive.get(kind, "-") for kind in ROLE_ORDER}
        return [(name, state[name], figures[name]) for name in ROLE_ORDER]

    def table(self, alive: Mapping[str, str]) -> Any:
        mode = "sync" if self.config.profile.sync else "async"
        return _role_table(
            f"rollstream up: run {self.config.run_id} ({mode}), "
            f"{time.monotonic() - self.started:.0f}s",
            self.rows(alive),
        )

    def line(self, alive: Mapping[str, str]) -> str:
        return " | ".join(f"{name} {figures}" for name, _, figures in self.rows(alive))


def _role_table(title: str, rows: list[tuple[str, str, str]]) -> Any:
    """The live display: a rich table of (role, process, progress) rows."""
    from rich.table import Table

    table = Table(title=title, expand=False)
    for column in ("role", "process", "progress"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def _label(sample: str) -> str:
    """The value of a one-label sample name: ``name{policy="solver"}`` -> ``solver``."""
    return sample.partition('="')[2].rstrip('"}')


class PoliciesDashboard:
    """A multi-policy run: per policy its trainer, stream worker and producer (a peer
    policy's records come from the producer that calls it), with the role instances each
    policy's heartbeats count."""

    def __init__(
        self,
        config: RollstreamConfig,
        logs: Mapping[str, TrainerLog],
        roles: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.views = {name: config.view(name) for name in logs}
        self.logs = logs
        self.roles = roles or {}  # per policy, a core.presence.Poller of run_roles
        self.started = time.monotonic()
        self.rates = {name: (Rate(), Rate()) for name in logs}

    def rows(self, alive: Mapping[str, str]) -> list[tuple[str, str, str]]:
        rows = []
        for name, log in self.logs.items():
            view = self.views[name]
            log.poll()
            last = log.rows[-1] if log.rows else {}
            found = self.roles[name].latest if name in self.roles else None
            trainer = (
                f"step {int(last.get('step', 0))}/{self.config.trainer.max_steps}  "
                f"v{int(last.get('version', 0))}  "
                f"reward {_fmt(last.get('reward/mean'))} "
                f"(last 10: {_fmt(log.mean('reward/mean', 10))})  "
                f"staleness {_fmt(last.get('staleness/mean'), '.2f')}"
            )
            s = scrape(int(view.streams.metrics_port or 0))
            records = _sum(s, "rollstream_streams_records_in_total")
            streams = (
                f"records {_fmt(records, '.0f')} ({self.rates[name][0].update(records):.1f}/s)  "
                f"groups {_fmt(_sum(s, 'rollstream_streams_groups_total'), '.0f')}  "
                f"stale {_fmt(s.get('rollstream_streams_stale_total'), '.0f')}  "
                f"dlq {_fmt(_sum(s, 'rollstream_streams_dlq_total'), '.0f')}"
            )
            if found is not None:
                trainer += f"  in run: {found.summary('trainer')}"
                streams += f"  in run: {found.summary('streams')}  lag {found.lag_line() or '-'}"
            rows.append((f"trainer-{name}", alive.get(f"trainer-{name}", "-"), trainer))
            rows.append((f"streams-{name}", alive.get(f"streams-{name}", "-"), streams))
            if f"producer-{name}" in alive:
                p = scrape(int(view.producers.rollout.metrics_port or 0))
                groups = p.get("rollstream_producer_groups_total")
                peers = ", ".join(
                    f"{_label(key)} {value:.0f}"
                    for key, value in p.items()
                    if key.startswith("rollstream_producer_peer_samples_total{")
                )
                producer = (
                    f"v{_fmt(p.get('rollstream_producer_version'), '.0f')}  "
                    f"groups {_fmt(groups, '.0f')} ({self.rates[name][1].update(groups):.1f}/s)  "
                    f"paused {_fmt(p.get('rollstream_producer_admission_paused'), '.0f')}"
                    + (f"  peer samples: {peers}" if peers else "")
                )
                if found is not None:
                    producer += f"  in run: {found.summary('producer')}"
                rows.append((f"producer-{name}", alive[f"producer-{name}"], producer))
        shown = {row[0] for row in rows}
        rows += [(name, alive[name], "") for name in sorted(alive) if name not in shown]
        return rows

    def table(self, alive: Mapping[str, str]) -> Any:
        return _role_table(
            f"rollstream up: run {self.config.run_id}, policies "
            f"{', '.join(self.logs)}, {time.monotonic() - self.started:.0f}s",
            self.rows(alive),
        )

    def line(self, alive: Mapping[str, str]) -> str:
        return " | ".join(f"{name} {figures}" for name, _, figures in self.rows(alive) if figures)


# --- the run -----------------------------------------------------------------------------


@dataclass
class UpResult:
    """How a run ended; written to ``<run_dir>/summary.json``."""

    run_id: str
    run_dir: str
    finished: bool  # the trainer reached max_steps
    reason: str
    seconds: float
    steps: int
    reward_first: float | None
    reward_last: float | None
    pids: dict[str, int]
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)  # per policy's trainer


class _StopFlag:
    """SIGINT/SIGTERM set it; the supervisor loop polls it."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum

    def __bool__(self) -> bool:
        return self.signum is not None


def _http_ok(url: str) -> Callable[[], bool]:
    def probe() -> bool:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)

    return probe


def _port_probe(port: int) -> Callable[[], bool]:
    from core.process import port_open

    return lambda: port_open(port)


def role_name(role: str, index: int) -> str:
    """``producer``, ``producer-1``, ...: the first of a kind keeps the plain name."""
    return role if index == 0 else f"{role}-{index}"


def role_specs(
    config_path: Path, config: RollstreamConfig, ports: Ports
) -> list[Any]:  # list[RoleSpec]
    """Every role as a user would start it, one command each: stream workers, the
    trainer, then an engine and a producer per producer. Further instances of a kind take
    their own ports, ids and data dirs on their command line (``--set``), as a user who
    starts one more by hand with the run's config would."""
    from core.process import RoleSpec

    rs = [sys.executable, "-m", "rollstream", "--config", str(config_path)]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cpus = _core_plan(config.up.pin_cores)
    run_dir = config_path.parent
    if config.policies:
        return policy_role_specs(config, rs, env, cpus, run_dir)
    specs = []
    for i, port in enumerate(ports.all_streams_metrics):
        own = [] if i == 0 else ["--set", f"streams.metrics_port={port}"]
        datadir = [] if i == 0 else [f"--datadir={run_dir / 'streams' / str(i)}"]
        specs.append(
            RoleSpec(
                role_name("streams", i),
                [*rs, *own, "stream", *datadir],
                env,
                _port_probe(port),
                cpus.get("streams"),
            )
        )
    train = [*rs, "train"]
    if config.up.trainer_ranks > 1:  # torch's own launcher starts and watches the ranks
        train = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={config.up.trainer_ranks}",
            "-m",
            *rs[2:],
            "train",
        ]
    specs.append(
        RoleSpec("trainer", train, env, _port_probe(ports.trainer_metrics), cpus.get("trainer"))
    )
    for i, (engine, metrics) in enumerate(
        zip(ports.engines, ports.all_producer_metrics, strict=True)
    ):
        url = f"http://127.0.0.1:{engine}"
        own = [] if i == 0 else ["--set", f"producers.rollout.metrics_port={metrics}"]
        producer_id = [] if i == 0 else ["--producer-id", f"{config.run_id}-producer-{i}"]
        serve_port = [] if i == 0 else ["--port", str(engine)]
        specs.append(
            RoleSpec(
                role_name("engine", i),
                [*rs, "serve", *serve_port],
                env,
                _http_ok(f"{url}/health"),
                cpus.get("engine"),
            )
        )
        specs.append(
            RoleSpec(
                role_name("producer", i),
                [*rs, *own, "produce", "--engine-url", url, *producer_id],
                env,
                _port_probe(metrics),
                cpus.get("producer"),
            )
        )
    return specs  # fmt: skip


def policy_role_specs(
    config: RollstreamConfig,
    rs: list[str],
    env: dict[str, str],
    cpus: dict[str, Any],
    run_dir: Path,
) -> list[Any]:
    """A multi-policy run: per policy its stream workers and trainer (``rollstream
    --policy NAME stream|train``), and per driving policy its engines and producers; a
    policy that is another's peer is generated inside that policy's producers. The first
    of a kind takes the policy's ports from the run's file, further ones (``--producers``,
    ``--stream-workers``) get free ones on their command line, as for one policy."""
    from core.process import RoleSpec, free_port

    up = config.up
    specs = []
    drivers = driving_policies(config)
    for name in sorted(config.policies):
        view = config.view(name)
        on = [*rs, "--policy", name]
        for i in range(up.stream_workers):
            port = int(view.streams.metrics_port or 0) if i == 0 else free_port()
            extra = [] if i == 0 else ["--set", f"streams.metrics_port={port}"]
            datadir = [] if i == 0 else [f"--datadir={run_dir / 'streams' / name / str(i)}"]
            specs.append(
                RoleSpec(
                    role_name(f"streams-{name}", i),
                    [*on, *extra, "stream", *datadir],
                    env,
                    _port_probe(port),
                    cpus.get("streams"),
                )
            )
        train = [*on, "train"]
        if up.trainer_ranks > 1:  # torch's own launcher starts and watches the ranks
            train = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={up.trainer_ranks}",
                "-m",
                *on[2:],
                "train",
            ]
        specs.append(
            RoleSpec(
                f"trainer-{name}",
                train,
                env,
                _port_probe(int(view.trainer.prometheus_port or 0)),
                cpus.get("trainer"),
            )
        )
        if name not in drivers:
            continue
        for i in range(up.producers):
            engine = int(view.producers.engine.port or 0) if i == 0 else free_port()
            metrics = int(view.producers.rollout.metrics_port or 0) if i == 0 else free_port()
            url = f"http://127.0.0.1:{engine}"
            extra = [] if i == 0 else ["--set", f"producers.rollout.metrics_port={metrics}"]
            producer_id = [] if i == 0 else ["--producer-id", f"{config.run_id}-producer-{i}"]
            specs.append(
                RoleSpec(
                    role_name(f"engine-{name}", i),
                    [*on, "serve", *([] if i == 0 else ["--port", str(engine)])],
                    env,
                    _http_ok(f"{url}/health"),
                    cpus.get("engine"),
                )
            )
            specs.append(
                RoleSpec(
                    role_name(f"producer-{name}", i),
                    [*on, *extra, "produce", "--engine-url", url, *producer_id],
                    env,
                    _port_probe(metrics),
                    cpus.get("producer"),
                )
            )
    return specs


def stop_order(names: list[str]) -> list[str]:
    """Producers first (no new data), then engines, stream workers, the trainer."""
    rank = {kind: i for i, kind in enumerate(STOP_ORDER)}
    return sorted(names, key=lambda name: rank[name.split("-")[0]])


def _core_plan(pin: bool) -> dict[str, frozenset[int]]:
    """Generation on the first cores, training and old logits on the last one."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return {}
    gen, train = frozenset(cores[:-1]), frozenset(cores[-1:])
    return {"engine": gen, "producer": gen, "streams": train, "trainer": train}


def run_up(base: RollstreamConfig, up: UpConfig, run_id: str, run_dir: Path) -> UpResult:
    """Bring everything up, supervise until done or signalled, tear everything down."""
    from core.process import Launcher, LaunchError
    from infra.services import Services

    started = time.monotonic()
    stop = _StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    ports = Ports.free()
    config = build_config(base, up, run_id, run_dir, ports)
    ports = Ports.of(config).with_more(up.producers, up.stream_workers)
    services = Services(config)
    ours = [
        s
        for s in (services.kafka, services.s3)
        if s is not None and not s.process.running()  # started here, so stopped here
    ]
    launcher = Launcher(run_dir / "logs")
    log = TrainerLog(Path(str(config.trainer.metrics_file)))
    policy_logs = {
        name: TrainerLog(Path(str(config.view(name).trainer.metrics_file)))
        for name in sorted(config.policies)
    }
    reason, finished = "interrupted", False
    try:
        click.echo(f"run {run_id}: {run_dir}", err=True)
        click.echo(
            f"model {config.trainer.model.spec}, {config.streams.old_logits.dtype} "
            f"(profile {config.profile.resolved_name}, precision {config.profile.precision})",
            err=True,
        )
        report = services.up(config.run_topic_specs())
        click.echo(
            f"kafka {report.bootstrap_servers}  s3 {report.s3_endpoint}  ({report.seconds:.1f}s)",
            err=True,
        )
        # The run's file keeps embedded services embedded (no address, no embedded
        # credentials): every role resolves them from the state dir, and
        # `rollstream --config <run_dir>/rollstream.toml infra up` starts them again later.
        config_path = run_dir / "rollstream.toml"
        write_config(config, config_path)
        config = services.resolved()
        if config.policies:
            for name in sorted(config.policies):
                start_groups_at_end(config.view(name))
        else:
            start_groups_at_end(config)
        specs = role_specs(config_path, config, ports)
        for spec in specs:
            launcher.add(spec)
        (run_dir / "pids.json").write_text("{}")
        producers = [s.name for s in specs if s.name.startswith("producer")]
        for spec in specs:  # producers last, once what they feed is ready
            if spec.name not in producers:
                launcher.roles[spec.name].start()
        for spec in specs:
            if stop:
                break
            role = launcher.roles[spec.name]
            if spec.name in producers:
                role.start()
            role.wait_ready(up.ready_timeout_s, cancelled=lambda: bool(stop))
            click.echo(f"{spec.name} ready (pid {role.pid}, log {role.log_file})", err=True)
        (run_dir / "pids.json").write_text(json.dumps(launcher.pids()))
        if not stop:
            reason, finished = _supervise(
                launcher, config, ports, log, stop, up.restarts, policy_logs
            )
    except LaunchError as err:
        reason = f"failed: {err}"
        click.echo(str(err), err=True)
    finally:
        click.echo("stopping roles ...", err=True)
        launcher.stop_all(stop_order(list(launcher.roles)), timeout_s=up.stop_timeout_s)
        for service in ours:
            service.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.poll()
    rewards = [row["reward/mean"] for row in log.rows if "reward/mean" in row]
    per_policy = {}
    for name, policy_log in policy_logs.items():
        policy_log.poll()
        per_policy[name] = policy_log.summary()
    if policy_logs:  # the run's figures are those of the policy that went furthest
        log = max(policy_logs.values(), key=lambda policy_log: len(policy_log.rows))
        rewards = [row["reward/mean"] for row in log.rows if "reward/mean" in row]
    result = UpResult(
        run_id=run_id,
        run_dir=str(run_dir),
        finished=finished,
        reason=reason,
        seconds=time.monotonic() - started,
        steps=len(log.rows),
        reward_first=sum(rewards[:10]) / len(rewards[:10]) if rewards else None,
        reward_last=sum(rewards[-10:]) / len(rewards[-10:]) if rewards else None,
        pids=launcher.pids(),
        policies=per_policy,
    )
    (run_dir / "summary.json").write_text(json.dumps(result.__dict__, indent=2))
    return result


def start_groups_at_end(config: RollstreamConfig) -> dict[str, int]:
    """Commit the current end offsets for this run's trainer and stream groups if they
    have none yet, and record the raw topic's end as the stream's start.

    Each run's trainer and stream app use their own consumer groups, which would otherwise
    start at the beginning of the shared topics and wade through earlier runs' records
    (the stream worker would dead-letter them as ``foreign_run``). With
    ``streams.first_start = "committed"`` (``up``'s default) the stream worker's gap guard
    starts from the offsets recorded in the compacted control topic ``<app_id>-start``
    (``streams.start``), which only this function writes, and only when it holds none
    for the raw topic yet; it runs before any producer of the run starts, so nothing of
    the run is skipped. No marker consumer group is left behind to show as lagging.
    Returns partitions committed (or recorded) per group (or control topic).
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    from core.topic_reader import committed_offsets, topic_partitions, whole_topic
    from streams.start import read_start_offsets, write_start_offsets

    done: dict[str, int] = {}
    kafka = config.kafka.client_config()
    streams = config.streams
    groups = {config.trainer.topics.group_id: config.trainer.topics.scored}
    if streams.first_start == "committed":
        groups[streams.app_id] = streams.topics.raw
    for group, topic in groups.items():
        consumer = Consumer({**kafka, "group.id": group, "enable.auto.commit": False})
        try:
            try:
                partitions = topic_partitions(consumer, topic)
            except KafkaException:
                continue  # created later by its role: nothing old to skip
            if not partitions:
                continue
            parts = [TopicPartition(topic, p) for p in partitions]
            if any(tp.offset >= 0 for tp in committed_offsets(consumer, parts)):
                continue  # a resumed run: keep its offsets
            ends = whole_topic(consumer, topic, partitions)
            if group == streams.app_id and not read_start_offsets(
                kafka, streams.start_topic, topic
            ):  # recorded before the commit: a retry after a crash keeps the first record
                offsets = {p: high for p, (_low, high) in ends.items()}
                write_start_offsets(
                    kafka, streams.start_topic, topic, offsets, streams.replication_factor
                )
                done[streams.start_topic] = len(offsets)
            consumer.commit(
                offsets=[TopicPartition(topic, p, high) for p, (_low, high) in ends.items()],
                asynchronous=False,
            )
            done[group] = len(ends)
        finally:
            consumer.close()
    return done


def _supervise(
    launcher: Any, config: RollstreamConfig, ports: Ports, log: TrainerLog, stop: _StopFlag,
    restarts: int, policy_logs: Mapping[str, TrainerLog] | None = None,
) -> tuple[str, bool]:  # fmt: skip
    """Show progress until the trainer ends, a role fails for good, or a signal arrives."""
    from rich.console import Console
    from rich.live import Live

    from rollstream.roles import roles_poller

    console = Console(stderr=True)
    if policy_logs:
        pollers = {name: roles_poller(config.view(name)) for name in policy_logs}
        dashboard: Dashboard | PoliciesDashboard = PoliciesDashboard(config, policy_logs, pollers)
    else:
        pollers = {"": roles_poller(config)}
        dashboard = Dashboard(config, ports, log, pollers[""])
    restarts_left = dict.fromkeys(launcher.roles, restarts)

    def alive() -> dict[str, str]:
        return {
            n: (f"pid {r.pid}" if r.running() else f"exit {r.returncode()}")
            for n, r in launcher.roles.items()
        }

    trainers = [name for name in launcher.roles if name.split("-")[0] == "trainer"]

    def check() -> tuple[str, bool] | None:
        # One trainer per policy in a multi-policy run: the run ends when the first
        # reaches max_steps (the others would soon starve: one producer feeds them all).
        for name in trainers:
            trainer = launcher.roles[name]
            if not trainer.running():
                code = trainer.returncode()
                if code != 0:
                    return (f"{name} exit {code}", False)
                return ("max_steps reached", True)
        for role in launcher.exited():
            if restarts_left[role.name] > 0:
                restarts_left[role.name] -= 1
                console.log(f"{role.name} exited ({role.returncode()}): restarting")
                role.start()
            else:
                return (f"{role.name} exited with code {role.returncode()}", False)
        return None

    last_line = 0.0
    try:
        if console.is_terminal:
            with Live(dashboard.table(alive()), console=console, refresh_per_second=2) as live:
                while not stop and (outcome := check()) is None:
                    time.sleep(0.5)
                    live.update(dashboard.table(alive()))
        else:
            while not stop and (outcome := check()) is None:
                time.sleep(0.5)
                if time.monotonic() - last_line > 10:
                    last_line = time.monotonic()
                    console.print(dashboard.line(alive()), soft_wrap=True)
    finally:
        for poller in pollers.values():
            poller.close()
    if stop:
        return f"stopped by {signal.Signals(stop.signum or 2).name}", False
    assert outcome is not None
    return outcome


def _default_run_id(config: RollstreamConfig) -> str:
    if "run_id" in config.model_fields_set:
        return config.run_id
    return "up-" + time.strftime("%Y%m%d-%H%M%S")


PROFILE_OPTIONS = ("sync", "model", "task", "staleness_window", "groups_per_step")


@click.command("up")
@click.option("--sync", "sync", flag_value=True, default=None, help="Synchronous baseline.")
@click.option("--async", "sync", flag_value=False, help="Asynchronous pipeline (default).")
@click.option(
    "--model",
    help="Model spec for every role ([profile] model): tiny, tiny:key=value,..., "
    "smollm2-135m-instruct or a checkpoint directory.",
)
@click.option("--task", help="Task (default: copy-first-digit-twice / arithmetic).")
@click.option("--max-steps", type=int, help="Trainer steps, then stop (default [up] 150).")
@click.option("--staleness-window", type=int, help="Async: versions generation may lead.")
@click.option("--groups-per-step", type=int, help="GRPO groups per optimiser step.")
@click.option("--run-id", help="Run name (default: the config's run_id, else up-<time>).")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Config, logs, metrics of this run (default <state_dir>/runs/<run_id>).",
)
@click.option("--pin-cores/--no-pin-cores", default=None, help="Pin roles to CPU cores.")
@click.option("--restarts", type=int, help="Start a crashed role again this many times.")
@click.option("--producers", type=int, help="Producers, each with its own engine (default 1).")
@click.option("--stream-workers", type=int, help="Stream workers (default 1).")
@click.option(
    "--trainer-ranks", type=int, help="Data-parallel trainer ranks via torchrun (default 1)."
)
@click.pass_context
def up(ctx: click.Context, run_id: str | None, run_dir: Path | None, **options: Any) -> None:
    """Run producers, streams and trainer as separate processes on this machine, with
    embedded Kafka and S3 unless configured otherwise, until the trainer's max_steps."""
    from rollstream.config import CONFIG_SOURCES, ConfigSources, with_options

    given = {k: v for k, v in options.items() if v is not None}
    profile = {k: given.pop(k) for k in PROFILE_OPTIONS if k in given}
    sources: ConfigSources = ctx.meta[CONFIG_SOURCES]
    try:  # the profile options change what every role derives: resolved with the sources
        config = sources.resolve(**({"profile": profile} if profile else {}))
    except ValidationError as err:
        raise click.UsageError(f"invalid configuration:\n{err}") from err
    if config.policy:
        raise click.UsageError(
            "`up` runs every policy of the run: leave out --policy (and ROLLSTREAM_POLICY)"
        )
    up_config = with_options(config.up, given)
    run_id = run_id or _default_run_id(config)
    run_dir = (run_dir or config.state_dir / "runs" / run_id).absolute()
    result = run_up(config, up_config, run_id, run_dir)
    click.echo(
        f"{result.reason}: {result.steps} steps in {result.seconds:.0f}s, mean reward "
        f"{_fmt(result.reward_first)} (first 10 steps) -> {_fmt(result.reward_last)} "
        f"(last 10); run dir {result.run_dir}"
    )
    for name, figures in result.policies.items():
        click.echo(
            f"  policy {name}: {figures['steps']} steps, mean reward "
            f"{_fmt(figures['reward_first'])} -> {_fmt(figures['reward_last'])}"
        )
    if not result.finished:
        sys.exit(130 if result.reason.startswith("stopped by") else 1)
