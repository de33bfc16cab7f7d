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
   every role is stopped (SIGTERM, SIGKILL after a timeout), and so are the embedded
   services an ``up`` started, once no other ``up`` uses them (``infra.service_users``).

This module composes the run; its parts are ``rollstream.up.plan`` (what to start:
config, ports, role commands, start offsets), ``rollstream.up.supervise`` (the processes:
start order, readiness, restarts, stop order, signals) and ``rollstream.up.display`` (the
live progress). A run without ``[policies]`` is a run of one policy: the same plan, loop
and display serve both.

Sync and async differ only in config (``[profile] sync``): sync sets the producers'
staleness window, the streams' and the trainer's ``max_staleness`` to 0, and the trainer
waits for every group of a step; the producers' admission credit is the trainer's
announced pace in both.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from core.config import ConfigurationError
from rollstream.config.run_files import RUN_CONFIG, default_run_dir
from rollstream.config.settings import RollstreamConfig, UpConfig
from rollstream.up.display import Dashboard, RewardWatch, eval_logs, fmt, trainer_logs
from rollstream.up.plan import (
    Ports,
    build_config,
    check_models,
    check_tasks,
    gateway_notes,
    plan_policies,
    role_forker,
    role_specs,
    start_groups_at_end,
    write_config,
)
from rollstream.up.supervise import start_roles, stop_on_signals, stop_order, supervise


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
    reward_failures: dict[str, float] = field(default_factory=dict)  # per reward function
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)  # per policy's trainer
    evaluations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # eval rows


def run_up(base: RollstreamConfig, up: UpConfig, run_id: str, run_dir: Path) -> UpResult:
    """Bring everything up, supervise until done or signalled, tear everything down."""
    from core.process import Launcher, LaunchError
    from infra.services import Services
    from rollstream.debug.roles import roles_poller

    started = time.monotonic()
    with stop_on_signals() as stop:
        ports = Ports.free()
        config = build_config(base, up, run_id, run_dir, ports)
        ports = Ports.of(config).with_more(up.producers, up.stream_workers)
        services = Services(config)
        prefork = role_forker(run_dir / "logs", up.ready_timeout_s) if up.prefork else None
        launcher = Launcher(run_dir / "logs", prefork)
        logs = trainer_logs(config)
        evals = eval_logs(config)
        reason, finished = "interrupted", False
        try:
            if prefork is not None:
                prefork.start()  # its imports overlap the services' start
            click.echo(f"run {run_id}: {run_dir}", err=True)
            click.echo(
                f"model {config.trainer.model.spec}, {config.streams.old_logits.dtype} "
                f"(profile {config.profile.resolved_name}, "
                f"precision {config.profile.precision})",
                err=True,
            )
            report = services.up_for_run(run_id, config.run_topic_specs())
            click.echo(
                f"kafka {report.bootstrap_servers}  s3 {report.s3_endpoint}  "
                f"({report.seconds:.1f}s)",
                err=True,
            )
            # The run's file keeps embedded services embedded (no address, no embedded
            # credentials): every role resolves them from the state dir, and
            # `rollstream --config <run_dir>/rollstream.toml infra up` starts them again.
            config_path = run_dir / RUN_CONFIG
            write_config(config, config_path)
            config = services.resolved()
            plan = plan_policies(config, ports)
            for policy in plan:
                start_groups_at_end(policy.config)
            for spec in role_specs(config_path, config, plan):
                launcher.add(spec)
            (run_dir / "pids.json").write_text("{}")
            start_roles(launcher, stop, up.ready_timeout_s)
            (run_dir / "pids.json").write_text(json.dumps(launcher.pids()))
            for note in gateway_notes(plan, config_path):
                click.echo(note, err=True)
            if not stop:
                pollers = {policy.name: roles_poller(policy.config) for policy in plan}
                try:
                    dashboard = Dashboard(config, plan, logs, pollers, evals)
                    watch = RewardWatch(
                        logs, up.reward_failure_steps, up.on_reward_failure == "stop"
                    )
                    reason, finished = supervise(
                        launcher, dashboard, stop, up.restarts, watches=[watch]
                    )
                finally:
                    for poller in pollers.values():
                        poller.close()
        except LaunchError as err:
            reason = f"failed: {err}"
            click.echo(str(err), err=True)
        finally:
            click.echo("stopping roles ...", err=True)
            launcher.stop_all(stop_order(list(launcher.roles)), timeout_s=up.stop_timeout_s)
            if others := services.release_run():
                click.echo(
                    f"embedded services left running: run(s) {', '.join(others)} use them "
                    "(the last run to end stops them)",
                    err=True,
                )
    for log in [*logs.values(), *evals.values()]:
        log.poll()
    furthest = max(logs.values(), key=lambda log: len(log.rows))  # the run's figures
    result = UpResult(
        run_id=run_id,
        run_dir=str(run_dir),
        finished=finished,
        reason=reason,
        seconds=time.monotonic() - started,
        **furthest.summary(),
        pids=launcher.pids(),
        policies={name: log.summary() for name, log in logs.items() if name},
        evaluations={name: log.rows for name, log in evals.items()},
    )
    (run_dir / "summary.json").write_text(json.dumps(result.__dict__, indent=2))
    return result


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
    from rollstream.config.settings import CONFIG_SOURCES, ConfigSources, with_options

    given = {k: v for k, v in options.items() if v is not None}
    profile = {k: given.pop(k) for k in PROFILE_OPTIONS if k in given}
    sources: ConfigSources = ctx.meta[CONFIG_SOURCES]
    try:  # the profile options change what every role derives: resolved with the sources
        config = sources.resolve(**({"profile": profile} if profile else {}))
    except ConfigurationError as err:  # names the key and where it was set
        raise click.UsageError(str(err)) from err
    except ValidationError as err:
        raise click.UsageError(f"invalid configuration:\n{err}") from err
    if config.policy:
        raise click.UsageError(
            "`up` runs every policy of the run: leave out --policy (and ROLLSTREAM_POLICY)"
        )
    up_config = with_options(config.up, given)
    run_id = run_id or _default_run_id(config)
    run_dir = (run_dir or default_run_dir(config.state_dir, run_id)).absolute()
    try:
        check_models(config)
        check_tasks(config)
    except ConfigurationError as err:
        raise click.UsageError(str(err)) from err
    result = run_up(config, up_config, run_id, run_dir)
    click.echo(
        f"{result.reason}: {result.steps} steps in {result.seconds:.0f}s, mean reward "
        f"{fmt(result.reward_first)} (first 10 steps) -> {fmt(result.reward_last)} "
        f"(last 10); run dir {result.run_dir}"
    )
    for name, figures in result.policies.items():
        click.echo(
            f"  policy {name}: {figures['steps']} steps, mean reward "
            f"{fmt(figures['reward_first'])} -> {fmt(figures['reward_last'])}"
        )
    if not result.finished:
        sys.exit(130 if result.reason.startswith("stopped by") else 1)
