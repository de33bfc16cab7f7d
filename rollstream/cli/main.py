"""The ``rollstream`` command: one entry point for every role and the embedded services.

Thin by design: the root group holds only ``config``, ``infra`` and ``topics``; every other
command is named here by where it lives and imported when it is invoked (or when
``--help`` lists it), so ``rollstream --help`` stays instant (no torch import).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from core.config import ConfigurationError
from core.process import ServiceError
from rollstream.config.settings import (
    CONFIG_SOURCES,
    ROLE_SECTIONS,
    ConfigSources,
    RollstreamConfig,
    parse_assignments,
    role_json,
)

RESOLVES_ITSELF = frozenset({"up"})
"""Commands whose own options change the profile: they resolve the sources themselves,
with those options, so the configuration is still resolved once."""


LAZY_COMMANDS = {
    "weights": "rollstream.cli.weights:weights",
    "serve": "rollstream.cli.produce:serve",
    "router": "rollstream.cli.produce:router",
    "produce": "rollstream.cli.produce:produce",
    "gateway": "rollstream.cli.produce:gateway",
    "eval": "rollstream.cli.produce:evaluate",
    "stream": "rollstream.cli.stream:stream",
    "train": "rollstream.cli.train:train",
    "up": "rollstream.up.run:up",
    "replay": "rollstream.debug.replay:replay",
    "inspect": "rollstream.debug.inspect:inspect_group",
    "roles": "rollstream.debug.roles:roles_command",
    "report": "rollstream.runs.report:report",
    "audit": "rollstream.runs.audit:audit_command",
    "export": "rollstream.runs.export:export",
    "export-dataset": "rollstream.runs.dataset:export_dataset",
    "fork": "rollstream.runs.fork:fork",
    "init": "rollstream.cli.starter:init",
}
"""Each command outside this module: ``module:attribute``, imported when it is needed."""


class RollstreamGroup(click.Group):
    """The CLI root: a setting that cannot work, or a service that does not answer, is
    shown as its message (exit 1), not as a traceback. The commands of ``LAZY_COMMANDS``
    are imported the first time they are looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            module, _, attribute = LAZY_COMMANDS[cmd_name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (ConfigurationError, ServiceError) as err:
            raise click.ClickException(str(err)) from err


@click.group(cls=RollstreamGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="ROLLSTREAM_CONFIG",
    help="TOML config file (env: ROLLSTREAM_CONFIG). ROLLSTREAM_* variables override it.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data and logs of embedded services (default ~/.local/state/rollstream).",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one value for any command, e.g. --set trainer.engine.lr=1e-4 (repeatable; "
    "wins over the file and the environment).",
)
@click.option(
    "--policy",
    metavar="NAME",
    help="In a multi-policy run, the policy this command serves or looks at: its "
    "[policies.NAME] settings and its own topics, weights and consumer groups.",
)
@click.pass_context
def main(
    ctx: click.Context,
    config_path: Path | None,
    state_dir: Path | None,
    assignments: tuple[str, ...],
    policy: str | None,
) -> None:
    """rollstream: asynchronous RL for LLMs over Apache Kafka."""
    try:
        overrides = parse_assignments(assignments)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--set") from err
    if state_dir:
        overrides["state_dir"] = state_dir
    policy = policy or overrides.pop("policy", None)  # `--set policy=NAME` names it too
    sources = ConfigSources(config_path, overrides, policy)
    ctx.meta[CONFIG_SOURCES] = sources
    if ctx.invoked_subcommand in RESOLVES_ITSELF:
        return
    try:
        ctx.obj = sources.resolve()
    except ConfigurationError as err:  # names the key and where it was set
        raise click.UsageError(str(err)) from err
    except ValidationError as err:
        raise click.UsageError(f"invalid configuration:\n{err}") from err


@main.command("config")
@click.option(
    "--role",
    type=click.Choice(list(ROLE_SECTIONS)),
    help="Only what this role receives: the shared sections and its own (and the "
    "[profile] they derive from).",
)
@click.pass_obj
def show_config(config: RollstreamConfig, role: str | None) -> None:
    """Print the effective configuration (profile, file, environment, --set) as JSON."""
    if role is None:
        click.echo(config.model_dump_json(indent=2))
    else:
        click.echo(json.dumps(role_json(config, role), indent=2))


@main.group()
def infra() -> None:
    """Embedded Kafka and S3: start, stop, inspect."""


@infra.command("fetch")
@click.pass_obj
def infra_fetch(config: RollstreamConfig) -> None:
    """Resolve the Kafka jars from Maven Central and locate SeaweedFS (no services start)."""
    from infra.kafka import resolve_kafka_jars
    from infra.s3 import weed_binary

    lib_dir = resolve_kafka_jars(config.kafka.kafka_version, config.cache_dir)
    click.echo(f"kafka {config.kafka.kafka_version} jars: {lib_dir}")
    click.echo(f"seaweedfs: {weed_binary()}")


@infra.command("up")
@click.option(
    "--s3-only",
    is_flag=True,
    help="Only the S3 store (a region's store, in its own --state-dir): no broker, no topics.",
)
@click.pass_obj
def infra_up(config: RollstreamConfig, s3_only: bool) -> None:
    """Start the embedded broker and S3 store (if not configured externally), declare topics."""
    from infra.services import Services

    services = Services(config, s3_only=s3_only)
    report = services.up(config.run_topic_specs())
    services.keep_running()  # until `infra down`, whichever run started them
    if not s3_only:
        click.echo(f"kafka  {report.bootstrap_servers}")
    click.echo(f"s3     {report.s3_endpoint}  bucket={report.bucket}")
    if report.topics.created:
        click.echo(f"topics created: {', '.join(report.topics.created)}")
    if report.topics.existing:
        click.echo(f"topics present: {', '.join(report.topics.existing)}")
    click.echo(f"ready in {report.seconds:.1f}s (state in {config.state_dir})")


@infra.command("down")
@click.pass_obj
def infra_down(config: RollstreamConfig) -> None:
    """Stop the embedded services; their data is kept for the next ``up``."""
    from infra.services import Services

    stopped = Services(config).down()
    click.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@infra.command("status")
@click.pass_obj
def infra_status(config: RollstreamConfig) -> None:
    """Show each service, its address and whether it answers. Exit 1 if any is down."""
    from infra.services import Services

    statuses = Services(config).status()
    for status in statuses:
        mark = "healthy" if status.healthy else "DOWN"
        click.echo(f"{status.name:<6} {mark:<8} {status.mode:<9} {status.address}  {status.detail}")
    if not all(status.healthy for status in statuses):
        sys.exit(1)


@main.group()
def topics() -> None:
    """Kafka topics declared in schemas/topics.py, by the names the config gives."""


@topics.command("ensure")
@click.pass_obj
def topics_ensure(config: RollstreamConfig) -> None:
    """Create missing topics; fail with a list of differences for conflicting ones."""
    from infra.services import Services
    from infra.topics import ensure_topics

    kafka = Services(config).running(s3=False).kafka
    report = ensure_topics(kafka.client_config(), config.run_topic_specs(), kafka)
    click.echo(f"created: {', '.join(report.created) or '-'}")
    click.echo(f"present: {', '.join(report.existing) or '-'}")


if __name__ == "__main__":
    main()
