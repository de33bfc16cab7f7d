"""``rollstream replay``: read any rollstream topic back, filtered, without moving offsets.

Why: a loss spike, a burst of dead letters or a drop in reward is explained by the records
behind it; replay finds them, shows them token by token, exports them to Parquet, or runs
them again through a stream step or a trainer step (``rollstream.debug.rerun``). What is read
and how (bounds, filters, decoding, never committing) is ``rollstream.debug.records``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from rollstream.config.settings import RollstreamConfig
from rollstream.debug.records import ReadBounds, RecordFilter, read_records, select

# --- the command ------------------------------------------------------------------------------


def parse_time(text: str) -> int:
    """Milliseconds since the epoch from ISO 8601 (naive = local time) or integer ms."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return int(datetime.fromisoformat(text).timestamp() * 1000)
    except ValueError as err:
        raise click.BadParameter(f"{text!r}: expected ISO 8601 or epoch milliseconds") from err


def parse_partition_offset(text: str) -> tuple[int, int]:
    partition, sep, offset = text.partition(":")
    if not sep or not partition.strip().isdigit() or not offset.strip().isdigit():
        raise click.BadParameter(f"expected PARTITION:OFFSET, got {text!r}", param_hint="--offset")
    return int(partition), int(offset)


def topic_names(config: RollstreamConfig) -> dict[str, str]:
    """Short names (raw, scored, stale, dlq, filtered, versions) to the configured topics."""
    topics = config.streams.topics
    return {
        "raw": topics.raw,
        "scored": topics.scored,
        "stale": topics.stale,
        "dlq": topics.dlq,
        "filtered": topics.filtered,
        "versions": topics.versions,
    }


def kafka_client_config(config: RollstreamConfig) -> dict[str, str]:
    """Client settings, with the embedded broker's address filled in when it is used."""
    if config.kafka.bootstrap_servers:
        return config.kafka.client_config()
    from infra.services import Services

    return Services(config).running(s3=False).kafka.client_config()


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def stacked(*options: Decorator) -> Decorator:
    """One decorator applying ``options`` as the same ``@click.option`` lines stacked in
    this order would (the first listed shows first in ``--help``)."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


# The options ``inspect`` shares with ``replay``.
time_options = stacked(
    click.option("--from-time", help="Start at this time (ISO 8601, naive = local; or epoch ms)."),
    click.option("--to-time", help="Stop before this time (ISO 8601 or epoch ms)."),
    click.option(
        "--idle-timeout",
        type=float,
        default=30.0,
        show_default=True,
        help="Give up on partitions that make no progress for this many seconds.",
    ),
)
render_options = stacked(
    click.option("--tokens/--no-tokens", default=True, help="Per-token tables (default on)."),
    click.option(
        "--tokenizer",
        default="auto",
        show_default=True,
        help="auto (from the record's task), tiny, none, or a tokenizer directory.",
    ),
)


def loss_options(when: str) -> Decorator:
    """``--weights-version`` and ``--dtype`` of the trainer step that scores records;
    ``when`` starts their help (when they apply)."""
    return stacked(
        click.option(
            "--weights-version",
            type=int,
            help=f"{when}policy version to load from the run's weight store "
            "(default: the initial weights of [trainer.model]).",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "bfloat16"]),
            help=f"{when}forward-pass dtype (default: bfloat16 if trainer.engine.bf16).",
        ),
    )


bounds_options = stacked(
    click.option(
        "--partition", "partitions", type=int, multiple=True, help="Read only this partition."
    ),
    click.option(
        "--offset",
        "offsets",
        multiple=True,
        metavar="P:N",
        help="Start partition P at offset N (repeatable; reads only the partitions named "
        "unless --partition says otherwise).",
    ),
    click.option("--from-offset", type=int, help="Start every partition at this offset."),
    click.option("--last", type=int, help="Read the last N records of each partition."),
    click.option("--to-offset", type=int, help="Stop after this offset (inclusive)."),
    time_options,
)
"""Where ``replay`` reads: partitions, offsets and times."""


def make_bounds(
    partitions: tuple[int, ...],
    offsets: tuple[str, ...],
    from_offset: int | None,
    last: int | None,
    to_offset: int | None,
    from_time: str | None,
    to_time: str | None,
    idle_timeout: float,
) -> ReadBounds:
    try:
        return ReadBounds(
            partitions=tuple(partitions),
            offsets=tuple(parse_partition_offset(o) for o in offsets),
            from_offset=from_offset,
            last=last,
            to_offset=to_offset,
            from_ms=parse_time(from_time) if from_time else None,
            to_ms=parse_time(to_time) if to_time else None,
            idle_timeout_s=idle_timeout,
        )
    except ValueError as err:
        raise click.UsageError(str(err)) from err


@click.command("replay")
@click.argument("topic")
@bounds_options
@click.option("--run", help="Only records of this run.")
@click.option("--group", "groups", multiple=True, help="Only this group id (repeatable).")
@click.option("--trajectory", "trajectories", multiple=True, help="Only this trajectory id.")
@click.option("--version", type=int, help="Only records with tokens generated by this version.")
@click.option("--min-version", type=int, help="Only records with tokens from this version on.")
@click.option("--max-version", type=int, help="Only records with tokens up to this version.")
@click.option("--min-reward", type=float, help="Only samples with at least this reward.")
@click.option("--max-reward", type=float, help="Only samples with at most this reward.")
@click.option("--min-staleness", type=int, help="Only samples at least this stale.")
@click.option("--max-staleness", type=int, help="Only samples at most this stale.")
@click.option("--reason", "reasons", multiple=True, help="Only dead letters with this reason.")
@click.option("--limit", type=int, help="Stop after this many selected records.")
@click.option(
    "--parquet",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Export the selected records to this Parquet file (one row per record).",
)
@click.option("--quiet", "-q", is_flag=True, help="Do not print the records.")
@render_options
@click.option(
    "--rerun",
    type=click.Choice(["stream", "train"]),
    help="Run the selected records again through a stream step or one trainer step.",
)
@click.option(
    "--trainer-version",
    type=int,
    help="--rerun stream: the trainer version to judge staleness against "
    "(default: the newest announced on the versions topic).",
)
@click.option("--flush", is_flag=True, help="--rerun stream: close groups still open at the end.")
@loss_options("--rerun train: ")
@click.option(
    "--groups-per-micro-batch",
    type=int,
    help="--rerun train: groups per micro-batch (default: trainer.batch.max_groups).",
)
@click.pass_obj
def replay(config: RollstreamConfig, topic: str, **opts: Any) -> None:
    """Read TOPIC (raw, scored, stale, dlq, versions, or a full topic name) back, filtered,
    without committing offsets; print, export to Parquet, or re-run the records."""
    config.require_policy()  # a multi-policy run: each policy's topics and files are its own
    from rollstream.debug.render import Renderer, RenderOptions

    name = topic_names(config).get(topic, topic)
    bounds = make_bounds(
        opts["partitions"],
        opts["offsets"],
        opts["from_offset"],
        opts["last"],
        opts["to_offset"],
        opts["from_time"],
        opts["to_time"],
        opts["idle_timeout"],
    )
    version = opts["version"]
    record_filter = RecordFilter(
        run=opts["run"],
        groups=frozenset(opts["groups"]),
        trajectories=frozenset(opts["trajectories"]),
        min_version=version if version is not None else opts["min_version"],
        max_version=version if version is not None else opts["max_version"],
        min_reward=opts["min_reward"],
        max_reward=opts["max_reward"],
        min_staleness=opts["min_staleness"],
        max_staleness=opts["max_staleness"],
        reasons=frozenset(opts["reasons"]),
    )
    client = kafka_client_config(config)
    records = select(read_records(client, name, bounds), record_filter, opts["limit"])
    renderer = Renderer(
        RenderOptions(
            tokens=opts["tokens"], tokenizer=opts["tokenizer"], cache_dir=config.cache_dir
        )
    )
    if not opts["quiet"]:
        for record in records:
            renderer.record(record)
    renderer.console.print(f"{len(records)} record(s) selected from {name}")
    if opts["parquet"] is not None:
        from rollstream.debug.parquet import write_export

        rows = write_export(records, opts["parquet"])
        renderer.console.print(f"wrote {rows} row(s) to {opts['parquet']}")
    if opts["rerun"] == "stream":
        from rollstream.debug.rerun import StreamRerunOptions, rerun_stream

        rerun_stream(
            config,
            records,
            StreamRerunOptions(
                run_id=opts["run"] or config.run_id,
                trainer_version=opts["trainer_version"],
                flush=opts["flush"],
            ),
            client,
            renderer,
        )
    elif opts["rerun"] == "train":
        from rollstream.debug.rerun import TrainRerunOptions, rerun_train

        rerun_train(
            config,
            records,
            TrainRerunOptions(
                weights_version=opts["weights_version"],
                dtype=opts["dtype"],
                groups_per_micro_batch=opts["groups_per_micro_batch"],
                run_id=opts["run"] or config.run_id,
            ),
            renderer,
        )
