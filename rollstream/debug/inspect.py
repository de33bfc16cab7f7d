"""``rollstream inspect GROUP_ID``: one GRPO group end to end.

Why: when a group looks wrong in the trainer's metrics, the question is always the same
chain — what did the generators produce, what did the stream attach and decide, and what
did the group do to the loss. This command answers it in one page:

1. **raw**: the group's trajectories on ``rollouts.raw`` (generation time, producer and
   region, segment versions, ``logp_infer`` per token);
2. **stale / dead-lettered**: samples of the group the stream filtered out, with the
   staleness or the dead-letter reason;
3. **scored**: the ``ScoredGroup`` on ``rollouts.scored`` (``logp_old``, the discrepancy
   ``d`` per token, advantages, staleness, k3 KL);
4. **loss**: the configured loss (``[trainer.loss]``) on that group alone, computed as
   ``rollstream replay --rerun train`` does (``rollstream.debug.rerun``).

Records are found by their Kafka key (every rollstream topic keys by group id), reading
each topic without a consumer group (``rollstream.debug.replay``); ``--from-time``/``--to-time``
bound the scan of large topics. Topic names come from ``[streams.topics]`` unless given.
"""

from __future__ import annotations

from typing import Any

import click

from rollstream.config.settings import RollstreamConfig
from rollstream.debug.records import ReadBounds, ReplayRecord, read_records
from rollstream.debug.replay import (
    kafka_client_config,
    loss_options,
    parse_time,
    render_options,
    time_options,
    topic_names,
)


def find_group(
    client_config: dict[str, str], topics: dict[str, str], group_id: str, bounds: ReadBounds
) -> dict[str, list[ReplayRecord]]:
    """The group's records on each topic (raw, stale, dlq, scored), in read order."""
    keys = frozenset({group_id.encode()})
    found: dict[str, list[ReplayRecord]] = {}
    for short in ("raw", "stale", "dlq", "scored"):
        found[short] = [
            r
            for r in read_records(client_config, topics[short], bounds, keys=keys)
            if r.group_id() == group_id
        ]
    return found


@click.command("inspect")
@click.argument("group_id")
@time_options
@click.option("--raw-topic", help="Default: [streams.topics] raw.")
@click.option("--scored-topic", help="Default: [streams.topics] scored.")
@click.option("--stale-topic", help="Default: [streams.topics] stale.")
@click.option("--dlq-topic", help="Default: [streams.topics] dlq.")
@render_options
@click.option("--loss/--no-loss", default=True, help="Compute the group's loss terms.")
@loss_options("The loss: ")
@click.pass_obj
def inspect_group(config: RollstreamConfig, group_id: str, **opts: Any) -> None:
    """Show GROUP_ID end to end: raw samples, stream decisions, scored group, loss terms."""
    config.require_policy()  # a multi-policy run: each policy's topics and files are its own
    from rollstream.debug.render import Renderer, RenderOptions
    from rollstream.debug.rerun import TrainRerunOptions, rerun_train

    topics = topic_names(config)
    for short in ("raw", "scored", "stale", "dlq"):
        if opts[f"{short}_topic"]:
            topics[short] = opts[f"{short}_topic"]
    bounds = ReadBounds(
        from_ms=parse_time(opts["from_time"]) if opts["from_time"] else None,
        to_ms=parse_time(opts["to_time"]) if opts["to_time"] else None,
        idle_timeout_s=opts["idle_timeout"],
    )
    renderer = Renderer(
        RenderOptions(
            tokens=opts["tokens"], tokenizer=opts["tokenizer"], cache_dir=config.cache_dir
        )
    )
    console = renderer.console
    found = find_group(kafka_client_config(config), topics, group_id, bounds)
    titles = {
        "raw": "raw trajectories",
        "stale": "filtered as stale",
        "dlq": "dead-lettered",
        "scored": "scored group",
    }
    for short in ("raw", "stale", "dlq", "scored"):
        records = found[short]
        console.rule(f"[bold]{titles[short]}[/] on {topics[short]}: {len(records)} record(s)")
        for record in records:
            renderer.record(record)
    scored = [r for r in found["scored"] if r.group is not None]
    if not any(found.values()):
        raise click.ClickException(f"group {group_id!r} was not found on {sorted(topics.values())}")
    if opts["loss"] and scored:
        if len(scored) > 1:
            console.print(f"{len(scored)} scored records for this group: the loss uses each")
        for record in scored:
            rerun_train(
                config,
                [record],
                TrainRerunOptions(
                    weights_version=opts["weights_version"],
                    dtype=opts["dtype"],
                    groups_per_micro_batch=1,
                    run_id=record.group.run_id if record.group is not None else config.run_id,
                ),
                renderer,
            )
    elif opts["loss"]:
        console.print("no scored group: no loss to compute")
