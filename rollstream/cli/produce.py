"""``rollstream serve``, ``router``, ``produce``, ``gateway`` and ``eval``: the producer
role's commands.

Both take the ``RollstreamConfig`` that the ``rollstream`` group puts in ``ctx.obj``
(``--config``, the environment, ``--set``: one way for every role) and give the role what
``rollstream.config.settings.role_config`` cuts from it: the shared sections and ``[producers]``,
with their own options on top. Heavy imports happen inside the commands, so ``--help``
stays instant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from core.config import LoraConfig, RoleConfig
from producers.config import ProducersConfig
from rollstream.config.settings import RollstreamConfig, role_config


def _logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine call


def _role(config: RollstreamConfig, options: dict[str, Any]) -> RoleConfig[ProducersConfig]:
    """What the producer role receives, the command-line options (a table in the section's
    layout) applied and validated."""
    try:
        return role_config(config, "producers", options)
    except (OSError, ValueError) as err:  # pydantic's ValidationError is a ValueError
        raise click.UsageError(f"invalid producers configuration:\n{err}") from err


@click.command("serve")
@click.option(
    "--engine",
    "kind",
    type=click.Choice(["cpu", "sglang"]),
    default="cpu",
    show_default=True,
    help="cpu: this project's engine; sglang: SGLang's own server (installed separately), "
    "with the run's model, host, port, API key and initial weight version.",
)
@click.option(
    "--engine-arg",
    "engine_args",
    multiple=True,
    help="One more flag for SGLang's server, e.g. --engine-arg=--tp-size=2 (repeatable; "
    "--engine sglang only).",
)
@click.option("--host", help="Address to bind (default from [engine], 127.0.0.1).")
@click.option("--port", type=int, help="Port (default from [engine], 30000; 0 = free).")
@click.option(
    "--api-key",
    help="Key every request but /health must send as 'Authorization: Bearer <key>' "
    "(default from [producers.engine] api_key); needed for a non-loopback --host.",
)
@click.option(
    "--model",
    help="Model spec: tiny, tiny:key=value,..., smollm2-135m-instruct or a checkpoint directory.",
)
@click.pass_obj
def serve(
    config: RollstreamConfig,
    kind: str,
    engine_args: tuple[str, ...],
    host: str | None,
    port: int | None,
    api_key: str | None,
    model: str | None,
) -> None:
    """Serve the run's model behind SGLang's native HTTP API: the CPU engine (the part RL
    needs, every endpoint: producers/engine/server.py) or SGLang itself."""
    config.require_policy()  # a multi-policy run: each policy's engine runs its model
    options = {"host": host, "port": port, "model": model, "api_key": api_key}
    shared, section = _role(config, {"engine": options})
    engine_config = section.engine
    key = engine_config.api_key.get_secret_value() if engine_config.api_key else None
    from producers.engine.auth import check_bind

    try:  # before the model loads: a refusal is the first thing the user sees
        check_bind(engine_config.host, key)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    if kind == "sglang":
        version = str(section.rollout.initial_version)
        _exec_sglang(engine_config.model, engine_config, key, version, engine_args, shared.lora)
    if engine_args:
        raise click.UsageError("--engine-arg is for --engine sglang")
    _logging()
    from producers.engine.engine import engine_from_config
    from producers.engine.server import SGLANG_RELEASE
    from producers.engine.server import serve as run_server

    engine = engine_from_config(section.engine, Path(shared.cache_dir), shared.lora)

    def ready(url: str) -> None:
        click.echo(f"engine {engine.model_path!r} serves SGLang {SGLANG_RELEASE}'s API at {url}")
        sys.stdout.flush()

    run_server(
        engine,
        section.engine.host,
        section.engine.port,
        on_ready=ready,
        max_request_tokens=section.engine.max_request_tokens,
        api_key=key,
        weights_dir=engine_config.weights_dir or Path(shared.state_dir) / "producers",
    )


def _exec_sglang(
    model: str,
    engine: Any,
    api_key: str | None,
    version: str,
    extra: tuple[str, ...],
    lora: LoraConfig | None,
) -> None:
    """Become SGLang's server for ``model`` (a checkpoint directory or a Hub id in the
    local cache), with LoRA slots for the run's ``[lora]``, or stop saying how to install
    it."""
    from infra.sglang import SGLangServer

    if model.split(":", 1)[0] == "tiny":
        raise click.UsageError("the tiny test model runs only on --engine cpu")
    server = SGLangServer(model, engine.host, engine.port, api_key, version, extra)
    if lora is not None:
        server = dataclasses.replace(
            server, lora_rank=lora.rank, lora_target_modules=tuple(lora.target_modules)
        )
    _become(server)


def _become(spec: Any) -> None:
    """Replace this process with ``spec``'s (an ``infra.sglang`` command line), so a
    supervisor's signals reach it; or say how to install what it needs."""
    from infra.sglang import NotInstalled, require_module

    try:
        require_module(spec.module, spec.install)
        argv = spec.argv()
    except (NotInstalled, ValueError) as err:
        raise click.ClickException(str(err)) from err
    os.execv(argv[0], argv)


@click.command("router")
@click.option(
    "--engine-url",
    "engine_urls",
    multiple=True,
    required=True,
    help="An engine the router balances over (repeat for each).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=30000, show_default=True, help="Port.")
@click.option("--metrics-port", type=int, default=29000, show_default=True, help="Prometheus port.")
@click.option(
    "--api-key",
    help="Key callers (and, passed on, the engines) need (default from [producers.engine] "
    "api_key); needed for a non-loopback --host.",
)
@click.pass_obj
def router(
    config: RollstreamConfig,
    engine_urls: tuple[str, ...],
    host: str,
    port: int,
    metrics_port: int,
    api_key: str | None,
) -> None:
    """Run SGLang's router (sglang-router) in front of several engines; point producers at
    it with [producers.rollout] engine_url and engine_router = true."""
    from infra.sglang import SGLangRouter
    from producers.engine.auth import check_bind

    _, section = _role(config, {"engine": {"api_key": api_key}})
    key = section.engine.api_key.get_secret_value() if section.engine.api_key else None
    exposure = (
        "SGLang's router",
        "could generate on every engine behind it; pass --api-key (or set [producers.engine] "
        "api_key, which the engines share)",
    )
    try:
        check_bind(host, key, exposure)
    except ValueError as err:
        raise click.UsageError(str(err)) from err
    _become(SGLangRouter(engine_urls, host, port, key, metrics_port))


@click.command("produce")
@click.option("--groups", type=int, help="Deliver this many groups, then stop.")
@click.option("--engine-url", help="Engine speaking SGLang's API; default: in-process.")
@click.option("--task", help="Task name (see producers.tasks).")
@click.option("--topic", help="Topic to publish to (default rollouts.raw).")
@click.option(
    "--region",
    help="Follow weights from this region's store ([weights.regions.<name>], or the home "
    "[s3] by its name) and tag records with it: one config file serves every machine.",
)
@click.option("--producer-id", help="This producer's id (its ledger; default: the host name).")
@click.pass_obj
def produce(
    config: RollstreamConfig,
    groups: int | None,
    engine_url: str | None,
    task: str | None,
    topic: str | None,
    region: str | None,
    producer_id: str | None,
) -> None:
    """Generate GRPO groups with the engine and publish them to Kafka."""
    overrides = {
        "groups": groups,
        "engine_url": engine_url,
        "task": task,
        "topic": topic,
        "producer_id": producer_id,
    }
    _produce(config, overrides, region)


@click.command("gateway")
@click.option("--host", help="Address to bind (default from [producers.rollout.gateway]).")
@click.option("--port", type=int, help="Port (default 8100; 0 = free).")
@click.option(
    "--api-key",
    help="Key every request but /health must send as 'Authorization: Bearer <key>' (the "
    "openai client's api_key); needed for a non-loopback --host.",
)
@click.option("--groups", type=int, help="Deliver this many groups, then stop.")
@click.option("--engine-url", help="Engine speaking SGLang's API; default: in-process.")
@click.option("--task", help="Task whose prompts the episodes are given (see producers.tasks).")
@click.option("--producer-id", help="This gateway's producer id (its ledger).")
@click.pass_obj
def gateway(
    config: RollstreamConfig,
    host: str | None,
    port: int | None,
    api_key: str | None,
    groups: int | None,
    engine_url: str | None,
    task: str | None,
    producer_id: str | None,
) -> None:
    """Serve the OpenAI-compatible API to agents and publish the episodes they close (every
    endpoint: producers/gateway/server.py); a producer in every other respect."""
    overrides = {
        "groups": groups,
        "engine_url": engine_url,
        "task": task,
        "producer_id": producer_id,
        "gateway": {"enabled": True, "host": host, "port": port, "api_key": api_key},
    }
    _produce(config, overrides, None)


def _produce(config: RollstreamConfig, overrides: dict[str, Any], region: str | None) -> None:
    """Run the producer role with ``overrides`` laid over ``[producers.rollout]``."""
    config.require_policy()
    shared, section = _role(config, {"rollout": overrides})
    gateway_config = section.rollout.gateway
    if gateway_config.enabled:
        from producers.engine.auth import check_bind
        from producers.gateway.server import EXPOSURE

        key = gateway_config.api_key
        try:  # before the model loads: a refusal is the first thing the user sees
            check_bind(gateway_config.host, key.get_secret_value() if key else None, EXPOSURE)
        except ValueError as err:
            raise click.UsageError(str(err)) from err
    _logging()
    from infra.services import Services
    from producers.app import run_producer
    from producers.engine.client import EngineUnavailable

    if region is not None:  # a usage error comes before what is or is not running
        try:
            shared.weights.region(region, shared.s3)
        except KeyError as err:
            raise click.UsageError(str(err.args[0])) from err
    resolved = Services(shared).running(s3=False)
    if region is not None:
        resolved = resolved.model_copy(update={"s3": resolved.weights.region(region, resolved.s3)})
    peers: dict[str, RoleConfig[ProducersConfig]] = {}
    for name in section.rollout.peers:  # each peer policy's own view, from the same sources
        peer_shared, peer_section = role_config(config.peer(name), "producers")
        peer_shared = Services(peer_shared).running(s3=False)
        # this machine's region
        peers[name] = RoleConfig(peer_shared.model_copy(update={"s3": resolved.s3}), peer_section)
    try:
        report = asyncio.run(run_producer(resolved, section, peer_configs=peers))
    except EngineUnavailable as err:  # one line saying what to start, not a traceback
        raise click.ClickException(
            f"{err}: start the engine first (`rollstream serve`), or point "
            "producers.rollout.engine_url (--engine-url) at one"
        ) from err
    click.echo(
        f"delivered {report.groups_delivered} group(s), {report.trajectories_delivered} "
        f"record(s), {report.tokens} tokens in {report.seconds:.1f}s "
        f"({report.interrupted_samples} interrupted sample(s), "
        f"{report.groups_dropped} group(s) dropped at shutdown)"
    )


@click.command("eval")
@click.option(
    "--every-versions",
    type=int,
    help="Evaluate each version that is a multiple of N (with --stored and N unset: every "
    "version the store holds).",
)
@click.option(
    "--engine-url", help="An engine of its own speaking SGLang's API; default: in-process."
)
@click.option("--max-evaluations", type=int, help="Stop after evaluating this many versions.")
@click.option(
    "--stored",
    is_flag=True,
    help="Evaluate the versions the weight store holds now, then exit, instead of following "
    "new ones: a finished run's, or a fork's.",
)
@click.option(
    "--run",
    "run",
    metavar="RUN",
    help="With --stored: evaluate run RUN's versions (a fork's), its rows where "
    "`rollstream report RUN` looks; default: the config's run_id.",
)
@click.option(
    "--versions",
    metavar="V1,V2,...",
    help="With --stored: these versions instead of every N-th.",
)
@click.pass_obj
def evaluate(
    config: RollstreamConfig,
    every_versions: int | None,
    engine_url: str | None,
    max_evaluations: int | None,
    stored: bool,
    run: str | None,
    versions: str | None,
) -> None:
    """Generate and score the task's eval split at every N-th version, never trained on
    (producers/evaluation.py); one metrics row per version."""
    config.require_policy()
    if (run is not None or versions is not None) and not stored:
        raise click.UsageError("--run and --versions go with --stored")
    chosen = _version_list(versions)
    other_run = run is not None and run != config.run_id
    if other_run:
        config = config.model_copy(update={"run_id": run})
    options = {"every_versions": every_versions, "engine_url": engine_url}
    shared, section = _role(config, {"eval": options})
    if other_run:  # the config's metrics_file is its own run's: RUN's rows go to the default
        rows = section.eval.model_copy(update={"metrics_file": None})
        section = section.model_copy(update={"eval": rows})
    if section.eval.every_versions < 1 and not stored:
        raise click.UsageError("set producers.eval.every_versions (or --every-versions) to N >= 1")
    _logging()
    import signal
    import threading

    from infra.services import Services
    from producers.evaluation import EvalError, eval_metrics_path, evaluate_stored, run_evaluator
    from weights.errors import WeightsError

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # measuring stored versions reads only the store; following new ones reads Kafka too
    resolved = Services(shared).running(kafka=not stored, s3=stored)
    if stored:
        measuring = evaluate_stored(resolved, section, chosen, stop)
    else:
        measuring = run_evaluator(resolved, section, stop, max_evaluations)
    try:
        count = asyncio.run(measuring)
    except (ValueError, EvalError, WeightsError) as err:  # no eval split, a version refused
        raise click.ClickException(str(err)) from err
    click.echo(f"evaluated {count} version(s) into {eval_metrics_path(resolved, section)}")


def _version_list(text: str | None) -> list[int] | None:
    """``--versions 0,10,20`` as a list; garbage is a usage error."""
    if text is None:
        return None
    try:
        chosen = [int(part) for part in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of versions") from None
    if any(v < 0 for v in chosen):
        raise click.BadParameter("versions are 0 or more", param_hint="--versions")
    return chosen
