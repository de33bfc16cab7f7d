"""``rollstream stream``: run one stream worker (``python -m streams.app worker``) under a
supervisor that starts it again if it crashes (``[streams.restart]``).

Thin on purpose: the ``[streams]`` section is validated before Faust and torch are
imported, so a bad config fails in a second with pydantic's message; the supervising
process imports neither.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from rollstream.supervisor import ChildSupervisor
from streams.config import CONFIG_ENV, load_stream_config


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
@click.pass_context
def stream(ctx: click.Context, loglevel: str, datadir: Path | None, check: bool) -> None:
    """Run a stream worker: validate, filter stale records, attach exact old logits,
    assemble GRPO groups and emit them to rollouts.scored, exactly once.

    Start several (same app_id) to share the partitions. Configuration: the [streams]
    and [weights] sections of the file given to ``rollstream --config`` (or
    $ROLLSTREAM_CONFIG).
    """
    root = ctx.find_root()
    config_path = root.params.get("config_path") if root is not ctx else None
    if config_path is not None:
        os.environ[CONFIG_ENV] = str(config_path)
    try:
        shared, streams, _weights = load_stream_config()
    except ValidationError as err:
        raise click.UsageError(f"invalid configuration:\n{err}") from err
    if check:
        click.echo(streams.model_dump_json(indent=2))
        return
    datadir = datadir or shared.state_dir / "streams" / streams.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    worker = [
        sys.executable,
        "-m",
        "streams.app",
        f"--datadir={datadir}",
        "worker",
        "--without-web",
        "-l",
        loglevel,
    ]
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(process)d] %(message)s")
    supervisor = ChildSupervisor(worker, streams.restart, name="stream worker")
    ctx.exit(supervisor.run())


if __name__ == "__main__":
    stream()
