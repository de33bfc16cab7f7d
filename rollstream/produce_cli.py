"""``rollstream serve`` and ``rollstream produce``: the producer role's commands.

Both take the ``RollstreamConfig`` that the ``rollstream`` group puts in ``ctx.obj``
(``--config``, the environment, ``--set``: one way for every role) and use its
``[producers]`` section, with their own options on top. Heavy imports happen inside the
commands, so ``--help`` stays instant.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from producers.config import EngineConfig, ProducersConfig, RolloutConfig
from rollstream.config import load_config


def _logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine call


def _section(config: Any, engine: dict, rollout: dict) -> ProducersConfig:
    """The producers config with command-line overrides applied (and validated)."""
    try:
        base = config.producers
        engine_values = {**base.engine.model_dump(), **_set(engine)}
        rollout_values = {**base.rollout.model_dump(), **_set(rollout)}
        return ProducersConfig(
            engine=EngineConfig.model_validate(engine_values),
            rollout=RolloutConfig.model_validate(rollout_values),
        )
    except (ValidationError, OSError, ValueError) as err:
        raise click.UsageError(f"invalid producers configuration:\n{err}") from err


def _set(values: dict) -> dict:
    return {key: value for key, value in values.items() if value is not None}


@click.command("serve")
@click.option("--host", help="Address to bind (default from [engine], 127.0.0.1).")
@click.option("--port", type=int, help="Port (default from [engine], 30000; 0 = free).")
@click.option(
    "--model",
    help="Model spec: tiny, tiny:key=value,..., smollm2-135m-instruct or a checkpoint directory.",
)
@click.pass_obj
def serve(
    config: Any,
    host: str | None,
    port: int | None,
    model: str | None,
) -> None:
    """Run the CPU engine behind SGLang's native HTTP API (/generate, /abort_request,
    /update_weights_from_disk, /get_model_info, /health)."""
    section = _section(config, {"host": host, "port": port, "model": model}, {})
    _logging()
    from producers.inference_engine import engine_from_config
    from producers.server import SGLANG_RELEASE
    from producers.server import serve as run_server

    engine = engine_from_config(section.engine, Path(config.cache_dir))

    def ready(url: str) -> None:
        click.echo(f"engine {engine.model_path!r} serves SGLang {SGLANG_RELEASE}'s API at {url}")
        sys.stdout.flush()

    run_server(
        engine,
        section.engine.host,
        section.engine.port,
        on_ready=ready,
        max_request_tokens=section.engine.max_request_tokens,
    )


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
@click.pass_context
def produce(
    ctx: click.Context,
    groups: int | None,
    engine_url: str | None,
    task: str | None,
    topic: str | None,
    region: str | None,
    producer_id: str | None,
) -> None:
    """Generate GRPO groups with the engine and publish them to Kafka."""
    config = ctx.obj
    config.require_policy()
    overrides = {
        "groups": groups,
        "engine_url": engine_url,
        "task": task,
        "topic": topic,
        "producer_id": producer_id,
    }
    section = _section(config, {}, overrides)
    _logging()
    from infra.services import Services
    from producers.app import run_producer

    resolved = Services(config).resolved()
    if region is not None:
        try:
            store = resolved.weights.region(region, resolved.s3)
        except KeyError as err:
            raise click.UsageError(str(err.args[0])) from err
        resolved = resolved.model_copy(update={"s3": store})
    peers = {}
    if section.rollout.peers:  # each peer policy's own view, from the same sources
        path, root_overrides = ctx.meta["rollstream.sources"]
        for name in section.rollout.peers:
            peer = Services(load_config(path, policy=name, **root_overrides)).resolved()
            peers[name] = peer.model_copy(update={"s3": resolved.s3})  # this machine's region
    report = asyncio.run(run_producer(resolved, section, peer_configs=peers))
    click.echo(
        f"delivered {report.groups_delivered} group(s), {report.trajectories_delivered} "
        f"record(s), {report.tokens} tokens in {report.seconds:.1f}s "
        f"({report.interrupted_samples} interrupted sample(s), "
        f"{report.groups_dropped} group(s) dropped at shutdown)"
    )
