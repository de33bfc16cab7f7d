"""``rollstream stream``: run one stream worker under a supervisor that starts it again if
it crashes (``[streams.restart]``).

The supervising process validates the ``[streams]`` section (a bad config fails in a
second with pydantic's message) and imports neither Faust nor torch; its child is a fork of
it that builds the Faust app (``streams.faust.app.build_app``) and runs it, as
``rollstream stream --no-supervisor`` does in its own process. Forked, the worker starts
with whatever the supervisor has imported: under ``rollstream up`` that is torch and
transformers (``core.prefork``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from core.process import ChildSupervisor
from rollstream.config.settings import RollstreamConfig, role_config


@click.command("stream")
@click.option(
    "--loglevel",
    "-l",
    type=click.Choice(["crit", "error", "warn", "info", "debug"]),
    default="info",
    show_default=True,
    help="Worker log level.",
)
@click.option(
    "--datadir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Faust data directory (default: <state_dir>/streams/<app_id>).",
)
@click.option("--check", is_flag=True, help="Validate the configuration, print it, and exit.")
@click.option(
    "--no-supervisor",
    "in_process",
    is_flag=True,
    help="Run the worker in this process, without restarts (what the supervisor starts).",
)
@click.pass_context
def stream(
    ctx: click.Context, loglevel: str, datadir: Path | None, check: bool, in_process: bool
) -> None:
    """Run a stream worker: validate, filter stale records, attach exact old logits,
    assemble GRPO groups and emit them to rollouts.scored, exactly once.

    Start several (same app_id) to share the partitions. Configuration: the [streams]
    and [weights] sections of the file given to ``rollstream --config`` (or
    $ROLLSTREAM_CONFIG).
    """
    config: RollstreamConfig = ctx.obj
    config.require_policy()
    shared, streams = role_config(config, "streams")
    if check:
        click.echo(streams.model_dump_json(indent=2))
        return
    from infra.services import Services

    resolved = Services(shared).running(s3=False)  # before a supervisor starts a doomed worker
    datadir = datadir or config.state_dir / "streams" / streams.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    if in_process:
        from streams.faust.app import build_app, run_worker

        run_worker(build_app(resolved, streams, datadir), loglevel)
        return
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(process)d] %(message)s")
    supervisor = ChildSupervisor(None, streams.restart, name="stream worker")
    code = supervisor.run()
    if code is None:  # the forked worker: Faust configures its logging, as in a new process
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
        from streams.faust.app import build_app, run_worker

        run_worker(build_app(resolved, streams, datadir), loglevel)
    ctx.exit(code)
