"""What ``rollstream up`` starts: the run's config and file, its ports, its roles'
commands, and where the run's consumer groups start.

A run without ``[policies]`` is planned as a run of one policy named ``""``: the same code
gives every policy its stream workers and trainer, and every driving policy its engines
and producers (``PolicyPlan``). The unnamed policy's roles keep the plain names
(``streams``, ``trainer``, ``engine``, ``producer``) and take no ``--policy``.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel

from core.config import ConfigurationError, merge_tables, to_toml
from core.prefork import PreforkServer
from core.process import RoleSpec
from rollstream.config.profiles import ProfileConfig
from rollstream.config.settings import RollstreamConfig, UpConfig
from rollstream.config.shared import SHARED, derived_sections
from rollstream.up.supervise import http_ok, port_probe

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
        from core.process import free_ports

        return cls(*free_ports(4))

    def with_more(self, producers: int, stream_workers: int) -> Ports:
        """These ports plus free ones for the producers and stream workers past the first."""
        from core.process import free_ports

        extra = producers - 1
        ports = free_ports(2 * extra + stream_workers - 1)
        return dataclasses.replace(
            self,
            more_engines=tuple(ports[:extra]),
            more_producer_metrics=tuple(ports[extra : 2 * extra]),
            more_streams_metrics=tuple(ports[2 * extra :]),
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


def up_sections(
    up: UpConfig, run_id: str, run_dir: Path, ports: Ports, *, gateway: bool = False
) -> dict[str, Any]:
    """What ``up`` itself sets unless the file says otherwise: ports, files in the run
    dir, per-run group ids, quiet roles, a per-run API key of the engines (which the
    producers read from the same file, written 0600) and, with ``gateway``, one of the
    gateway (its agents read it there). What the roles learn with comes from the
    ``[profile]`` (``rollstream.config.profiles``), already in the loaded config."""
    rollout: dict[str, Any] = {
        "producer_id": f"{run_id}-producer-0",
        "metrics_port": ports.producer_metrics,
        "progress": False,
    }
    if gateway:
        rollout["gateway"] = {"api_key": secrets.token_urlsafe(32)}
    return {
        "run_id": run_id,
        "producers": {
            "engine": {"port": ports.engine, "api_key": secrets.token_urlsafe(32)},
            "rollout": rollout,
            "eval": {"metrics_file": str(run_dir / "eval.jsonl")},
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
    for key in overridden_declarations(base):  # the run's file holds what each role runs with
        explicit["profile"].pop(key, None)
    gateway = base.producers.rollout.gateway.enabled
    merged = merge_tables(up_sections(up, run_id, run_dir, ports, gateway=gateway), explicit)
    merged["up"] = up.model_dump()
    merged["trainer"]["max_steps"] = up.max_steps  # [up] max_steps (or --max-steps) decides
    if merged.get("policies"):
        merged["policies"] = {
            name: merge_tables(policy_ports(), with_own_profile(base, table))
            for name, table in merged["policies"].items()
        }
    return RollstreamConfig.model_validate(merged)


def overridden_declarations(config: RollstreamConfig) -> list[str]:
    """The ``[profile]`` keys declaring a shared setting that a role of ``config`` runs
    without: a source that wins over the declaration (``up --set``) set the role's key.
    The run's file is one source, so it keeps the roles' values and not the declaration."""
    declared = config.profile.model_dump(include=config.profile.model_fields_set)
    keys = []
    for setting in SHARED.values():
        wanted = {path: value(config.profile) for path, value in setting.roles.items()}
        if setting.declared(declared) and any(
            not setting.same(_at(config, path), value) for path, value in wanted.items()
        ):
            keys += [key for key in setting.declared_by if key in declared]
    return keys


def _at(config: BaseModel, path: tuple[str, ...]) -> Any:
    node: Any = config
    for part in path:
        node = getattr(node, part)
    return node


def with_own_profile(base: RollstreamConfig, table: dict[str, Any]) -> dict[str, Any]:
    """A policy's table with what its own ``[profile]`` derives laid under it. The run's
    file holds the root profile's settings as explicit values, which a policy's profile
    would otherwise lose to (``load_config`` applies a policy's profile before them)."""
    if "profile" not in table:
        return table
    own = merge_tables(base.profile.model_dump(exclude_unset=True), table["profile"])
    return merge_tables(derived_sections(ProfileConfig.model_validate(own)), table)


def policy_ports() -> dict[str, Any]:
    """Free ports for one policy's roles under ``up`` (each policy has its own)."""
    from core.process import free_ports

    engine, producer, streams, trainer = free_ports(4)
    return {
        "producers": {"engine": {"port": engine}, "rollout": {"metrics_port": producer}},
        "streams": {"metrics_port": streams},
        "trainer": {"prometheus_port": trainer},
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
    values = config.model_dump(mode="python")  # the profile as declared: it declares
    values["profile"] = config.profile.model_dump(mode="python", exclude_unset=True)
    with os.fdopen(fd, "w") as fh:
        fh.write(to_toml(values))
    with path.open("rb") as fh:
        again = RollstreamConfig.model_validate(tomllib.load(fh))
    if again != config:
        raise ValueError(
            f"{path} does not read back as the config it was written from "
            "(a value TOML cannot hold, such as an explicit empty optional)"
        )


def check_models(config: RollstreamConfig) -> None:
    """Resolve every model the run's roles name on this machine, before anything starts:
    a Hub id missing from the cache or a directory that is not a checkpoint is a
    ``ConfigurationError`` naming it, not a role that dies after the services came up."""
    from core.models import model_directory

    specs: set[str] = set()
    for view in policy_views(config).values():
        specs.update(
            (view.trainer.model.spec, view.streams.old_logits.model, view.producers.engine.model)
        )
    for spec in sorted(specs):
        try:
            model_directory(spec, config.cache_dir)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigurationError(str(exc)) from exc


def check_tasks(config: RollstreamConfig) -> None:
    """Check every policy's task options against its task, before anything starts: a
    misspelt option is a ``ConfigurationError`` naming it, not an evaluator that dies
    after the run came up."""
    from producers.tasks.catalog import check_task_options

    for name, view in policy_views(config).items():
        rollout = view.producers.rollout
        section = f"policies.{name}.producers.rollout" if name else "producers.rollout"
        check_task_options(rollout.task, rollout.task_options, section)


# --- the run's policies ------------------------------------------------------------------


def policy_views(config: RollstreamConfig) -> dict[str, RollstreamConfig]:
    """Each policy's view of the run by name; a run without ``[policies]`` is the one
    policy ``""``, whose view is the run's config itself."""
    return {name: config.view(name) if name else config for name in config.policy_names}


@dataclass(frozen=True)
class PolicyPlan:
    """One policy's roles under ``up``: its view of the run, the ports its roles take,
    and whether it drives episodes (gets engines and producers; a peer policy's records
    come from the producers of the policies that call it)."""

    name: str  # "" for a run without [policies]
    config: RollstreamConfig  # the policy's view
    ports: Ports
    drives: bool = True

    def role(self, kind: str, index: int = 0) -> str:
        """``streams``, ``streams-1``; ``streams-solver``, ``streams-solver-1``, ..."""
        return role_name(f"{kind}-{self.name}" if self.name else kind, index)

    @property
    def option(self) -> list[str]:
        """What a role's command line says to serve this policy."""
        return ["--policy", self.name] if self.name else []


def plan_policies(config: RollstreamConfig, ports: Ports | None = None) -> list[PolicyPlan]:
    """Every policy of the run with its ports: the first of each kind where its view
    says, free ones for the producers and stream workers past the first. ``ports``: those
    ``up`` already chose for a run without ``[policies]`` (default: its config's)."""
    up = config.up
    views = policy_views(config)
    drivers = driving_policies(config) if config.policies else [""]
    plan = []
    for name, view in views.items():
        drives = name in drivers
        if ports is None or name:
            ports_of = Ports.of(view).with_more(up.producers if drives else 1, up.stream_workers)
        else:
            ports_of = ports
        plan.append(PolicyPlan(name, view, ports_of, drives))
    return plan


# --- the roles ---------------------------------------------------------------------------


def gateway_notes(plan: Sequence[PolicyPlan], config_path: Path) -> list[str]:
    """Where each gateway of the run serves its agents, and where its key is: the one
    thing an agent needs that is not in the terminal otherwise."""
    from producers.config import GATEWAY_KEY_SETTING

    notes = []
    for policy in plan:
        gateway = policy.config.producers.rollout.gateway
        if not (policy.drives and gateway.enabled):
            continue
        port = gateway.port or "<a free port: the producer's log names it>"
        key = f"key: {GATEWAY_KEY_SETTING} in {config_path}" if gateway.api_key else "no key"
        name = f" {policy.name}" if policy.name else ""
        notes.append(f"gateway{name} http://{gateway.host}:{port} ({key})")
    return notes


PRELOADED = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.auto.tokenization_auto",
    "rollstream.cli.main",
    "infra.services",
    "producers.engine.server",
    "producers.app",
    "producers.evaluation",
    "producers.gateway.server",
    "streams.faust.app",
    "consumers.trainer",
)
"""What the prefork server imports before it forks a role (``[up] prefork``): the
libraries whose import is most of a model role's start-up, then each role command's own
modules (and so Faust, aiokafka, aiohttp, pyarrow), which every role would otherwise
compile and import again; nothing that touches CUDA (DeepSpeed probes it on import, so
the trainer imports it itself)."""


def role_env() -> dict[str, str]:
    """What every role's environment adds to ``up``'s."""
    return {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def role_forker(log_dir: Path, ready_timeout_s: float) -> PreforkServer:
    """The prefork server ``up``'s roles are forked from: ``PRELOADED`` imported in ``up``'s
    environment plus ``role_env``, its log beside the roles' (started on first use)."""
    return PreforkServer(
        PRELOADED, {**os.environ, **role_env()}, log_dir / "prefork.log", ready_timeout_s
    )


def role_name(role: str, index: int) -> str:
    """``producer``, ``producer-1``, ...: the first of a kind keeps the plain name."""
    return role if index == 0 else f"{role}-{index}"


def role_specs(
    config_path: Path, config: RollstreamConfig, plan: Sequence[PolicyPlan] | None = None
) -> list[RoleSpec]:
    """Every role as a user would start it, one command each: per policy its stream
    workers and trainer, then per driving policy an engine and a producer per producer
    (``plan``, default ``plan_policies(config)``). Further instances of a kind take their
    own ports, ids and data dirs on their command line (``--set``), as a user who starts
    one more by hand with the run's config would."""
    rs = [sys.executable, "-m", "rollstream", "--config", str(config_path)]
    env = role_env()
    cpus = _core_plan(config.up.pin_cores)
    specs: list[RoleSpec] = []
    for policy in plan_policies(config) if plan is None else plan:
        on = [*rs, *policy.option]
        specs += _policy_specs(policy, config, on, env, cpus, config_path.parent)
    return specs


def _policy_specs(
    policy: PolicyPlan,
    config: RollstreamConfig,
    on: list[str],
    env: dict[str, str],
    cpus: dict[str, frozenset[int]],
    run_dir: Path,
) -> list[RoleSpec]:
    """One policy's roles (``rollstream [--policy NAME] stream|train|serve|produce|eval``)."""
    ports = policy.ports
    specs = []
    for i, port in enumerate(ports.all_streams_metrics):
        own = [] if i == 0 else ["--set", f"streams.metrics_port={port}"]
        datadir = [] if i == 0 else [f"--datadir={run_dir / 'streams' / policy.name / str(i)}"]
        specs.append(
            RoleSpec(
                policy.role("streams", i),
                [*on, *own, "stream", *datadir],
                env,
                port_probe(port),
                cpus.get("streams"),
            )
        )
    train = [*on, "train"]
    train_env = env
    if config.up.trainer_ranks > 1:  # torch's own launcher starts and watches the ranks
        train = trainer_launcher(config.up.trainer_ranks, policy.role("trainer"), on)
        train_env = {**env, "MASTER_ADDR": LOOPBACK}
    specs.append(
        RoleSpec(
            policy.role("trainer"),
            train,
            train_env,
            port_probe(ports.trainer_metrics),
            cpus.get("trainer"),
        )
    )
    if not policy.drives:
        return specs
    for i, (engine, metrics) in enumerate(
        zip(ports.engines, ports.all_producer_metrics, strict=True)
    ):
        url = f"http://127.0.0.1:{engine}"
        own = [] if i == 0 else ["--set", f"producers.rollout.metrics_port={metrics}"]
        producer_id = [] if i == 0 else ["--producer-id", f"{config.run_id}-producer-{i}"]
        serve_port = [] if i == 0 else ["--port", str(engine)]
        specs.append(
            RoleSpec(
                policy.role("engine", i),
                [*on, "serve", *serve_port],
                env,
                http_ok(f"{url}/health"),
                cpus.get("engine"),
            )
        )
        specs.append(
            RoleSpec(
                policy.role("producer", i),
                [*on, *own, "produce", "--engine-url", url, *producer_id],
                env,
                port_probe(metrics),
                cpus.get("producer"),
            )
        )
    if policy.config.producers.eval.every_versions:  # its own engine, in its process
        specs.append(RoleSpec(policy.role("eval"), [*on, "eval"], env, None, cpus.get("producer")))
    return specs


LOOPBACK = "127.0.0.1"


def trainer_launcher(ranks: int, rdzv_id: str, on: list[str]) -> list[str]:
    """torchrun for ``ranks`` trainer ranks on this machine, meeting at a rendezvous on
    loopback (``--standalone`` names ``localhost``, which may resolve to another address),
    on a port torch picks (``:0``, as ``--standalone`` does)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={ranks}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={LOOPBACK}:0",
        f"--rdzv-id={rdzv_id}",
        f"--local-addr={LOOPBACK}",  # the ranks' MASTER_ADDR
        "-m",
        *on[2:],
        "train",
    ]


def _core_plan(pin: bool) -> dict[str, frozenset[int]]:
    """Generation on the first cores, training and old logits on the last one."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return {}
    gen, train = frozenset(cores[:-1]), frozenset(cores[-1:])
    return {"engine": gen, "producer": gen, "streams": train, "trainer": train}


# --- where the run's groups start --------------------------------------------------------


def start_groups_at_end(config: RollstreamConfig) -> dict[str, int]:
    """Commit the current end offsets for this run's trainer and stream groups if they
    have none yet, and record the raw topic's end as the stream's start.

    Each run's trainer and stream app use their own consumer groups, which would otherwise
    start at the beginning of the shared topics and wade through earlier runs' records
    (the stream worker would dead-letter them as ``foreign_run``). With
    ``streams.first_start = "committed"`` (``up``'s default) the stream worker's gap guard
    starts from the offsets recorded in the compacted control topic ``<app_id>-start``
    (``streams.faust.start``), which only this function writes, and only when it holds none
    for the raw topic yet; it runs before any producer of the run starts, so nothing of
    the run is skipped. No marker consumer group is left behind to show as lagging.
    Returns partitions committed (or recorded) per group (or control topic).
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    from core.config import RetryConfig
    from core.retry import retrying
    from core.topic_reader import committed_offsets, topic_partitions, whole_topic
    from streams.faust.start import read_start_offsets, write_start_offsets

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
            # a topic created a moment ago may have no leader yet (NOT_LEADER_FOR_PARTITION)
            for attempt in retrying(
                RetryConfig(initial_s=0.2, max_s=2.0), (KafkaException,), f"{topic}'s end offsets",
                max_attempts=15,
            ):  # fmt: skip
                with attempt:
                    ends = whole_topic(consumer, topic, partitions)
            if group == streams.app_id and not read_start_offsets(
                kafka, streams.start_topic, topic
            ):  # recorded before the commit: a retry after a crash keeps the first record
                offsets = {p: high for p, (_low, high) in ends.items()}
                write_start_offsets(kafka, streams.start_topic, topic, offsets, config.kafka)
                done[streams.start_topic] = len(offsets)
            consumer.commit(
                offsets=[TopicPartition(topic, p, high) for p, (_low, high) in ends.items()],
                asynchronous=False,
            )
            done[group] = len(ends)
        finally:
            consumer.close()
    return done
