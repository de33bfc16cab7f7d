"""``rollstream fork RUN --as NEW``: train a run again from its log, under a new run id.

The fork's trainer (``consumers.fork``) trains exactly the steps RUN's trainer trained,
from RUN's recorded scored groups, with the configuration of this command (the same file
as RUN's, ``--set`` laid over it: the one thing changed). It starts from RUN's initial
weights (``[trainer.model]``) or, with ``--from-step N``, from RUN's checkpoint of step N
(optimiser state included). With ``--restream`` the groups are made again first, from
RUN's raw topic with the fork's stream settings (``rollstream.fork_restream``), and each
step trains those of its samples the restream kept. Everything the fork writes is its
own, under ``<state_dir>/trainer/NEW/``: ``fork.json`` (what it forks, with which settings),
``checkpoints/``, ``ledger.jsonl``, ``metrics.jsonl`` (where ``rollstream report NEW``
finds it); and its weight lineage in S3 under NEW. Run the same command again to resume
a fork that stopped or was killed; the same name with other settings is refused.
With ``--follow`` the fork keeps up with a run that is still training: past the last
step RUN's ledger held at its start, it trains each step RUN's trainer records next.

At the end it compares, version by version, the fork's published weights with RUN's
(the manifests' ``state_sha256``): a control arm (nothing changed) is identical at every
version when RUN trained with ``[trainer.engine] deterministic``.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import click
import orjson
from pydantic import ValidationError

from rollstream.config import CONFIG_SOURCES, ConfigSources, RollstreamConfig, parse_assignments

FORK_FILE = "fork.json"


def read_fork(home: Path) -> dict[str, Any] | None:
    """The ``fork.json`` of a run's home, None when it is no fork."""
    path = home / FORK_FILE
    return orjson.loads(path.read_bytes()) if path.is_file() else None


def list_forks(config: RollstreamConfig, run: str) -> list[dict[str, Any]]:
    """Every fork of ``run`` under this state dir, oldest first, with its progress."""
    from consumers.checkpoint import TrainingLedger

    forks = []
    root = config.state_dir / "trainer"
    for path in sorted(root.glob(f"*/{FORK_FILE}")) + sorted(root.glob(f"*/*/{FORK_FILE}")):
        fork = orjson.loads(path.read_bytes())
        if fork.get("run") == run and fork.get("policy", "") == config.policy:
            steps = TrainingLedger.read(path.parent / "ledger.jsonl")
            fork["trained_to"] = steps[-1][0] if steps else fork["from_step"]
            fork.setdefault("follow", False)
            forks.append(fork)
    return sorted(forks, key=lambda f: f.get("created", ""))


def compare_versions(config: RollstreamConfig, run: str, fork: str) -> list[tuple[int, str, str]]:
    """``(version, RUN's state_sha256, the fork's)`` of every version both lineages hold."""
    from infra.services import Services
    from weights.manifest import Manifest
    from weights.store import WeightStore

    s3 = Services(config).resolved().s3
    theirs = WeightStore.from_config(s3, run, config.policy)
    ours = WeightStore.from_config(s3, fork, config.policy)
    both = sorted(set(theirs.versions()) & set(ours.versions()))
    return [
        (
            v,
            Manifest.from_bytes(theirs.read_manifest(v)).state_sha256,
            Manifest.from_bytes(ours.read_manifest(v)).state_sha256,
        )
        for v in both
    ]


def fork_manifest(
    run: str,
    new: str,
    policy: str,
    from_step: int,
    to_step: int | None,
    assignments: tuple[str, ...],
    restream: bool,
    follow: bool,
) -> dict[str, Any]:
    """What ``fork.json`` says; ``to_step`` None: a fork following RUN to its end."""
    return {
        "run": run,
        "fork": new,
        "policy": policy,
        "from_step": from_step,
        "to_step": to_step,
        "set": list(assignments),
        "restream": restream,
        "follow": follow,
    }


def claim_home(home: Path, manifest: dict[str, Any]) -> bool:
    """Make ``home`` the fork's (True), or find it is already (False: a resume);
    ``ClickException`` when it belongs to another run or another fork."""
    existing = read_fork(home)
    if existing is not None:
        older = {"restream": False, "follow": False}  # fork.json of forks made before these
        kept = older | {k: v for k, v in existing.items() if k != "created"}
        if kept != manifest:
            raise click.ClickException(
                f"{manifest['fork']} is already a fork of {existing['run']} with other "
                f"settings ({home / FORK_FILE}); choose another name"
            )
        return False
    if home.exists() and any(home.iterdir()):
        raise click.ClickException(
            f"{manifest['fork']} is a run of its own ({home} holds its files): choose another name"
        )
    home.mkdir(parents=True, exist_ok=True)
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    (home / FORK_FILE).write_bytes(
        orjson.dumps({**manifest, "created": created}, option=orjson.OPT_INDENT_2)
    )
    return True


@click.command("fork")
@click.argument("run")
@click.option("--as", "new", metavar="NEW", help="The fork's run id (required unless --list).")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="What the fork changes, e.g. --set trainer.loss.type=mu_grpo (repeatable).",
)
@click.option(
    "--from-step",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Start from RUN's checkpoint of this step (0: RUN's initial weights).",
)
@click.option(
    "--to-step",
    type=click.IntRange(min=1),
    help="Stop after this step (default: the last step RUN's ledger holds).",
)
@click.option(
    "--restream",
    is_flag=True,
    help="Run RUN's raw topic through the stream again with the fork's [streams] settings "
    "into the fork's own scored topic, and train on that.",
)
@click.option(
    "--follow",
    is_flag=True,
    help="RUN is still training: after the steps its ledger holds, train those it records "
    "next, until --to-step, RUN's max_steps, or its ledger stops growing (--follow-idle).",
)
@click.option(
    "--follow-idle",
    "follow_idle_s",
    type=click.FloatRange(min=1.0),
    default=120.0,
    show_default=True,
    help="With --follow: end once RUN's ledger has not grown for this many seconds.",
)
@click.option("--list", "show_list", is_flag=True, help="List RUN's forks and exit.")
@click.option(
    "--timeout", "timeout_s", default=60.0, show_default=True, help="Topic read timeout (s)."
)
@click.pass_context
def fork(
    ctx: click.Context,
    run: str,
    new: str | None,
    assignments: tuple[str, ...],
    from_step: int,
    to_step: int | None,
    restream: bool,
    follow: bool,
    follow_idle_s: float,
    show_list: bool,
    timeout_s: float,
) -> None:
    """Train RUN again from its recorded scored groups, step by step as RUN's trainer
    did, as run NEW (its own checkpoints, ledger, metrics and weights)."""
    config: RollstreamConfig = ctx.obj
    config.require_policy()
    if show_list:
        for f in list_forks(config, run):
            changed = " ".join(f.get("set", [])) or "(control: nothing changed)"
            last = f["to_step"] if f["to_step"] is not None else "(following)"
            click.echo(
                f"{f['fork']}: steps {f['from_step'] + 1}..{last}, trained to "
                f"{f['trained_to']}, {changed}"
            )
        return
    if not new:
        raise click.UsageError("--as NEW is required")
    if new == run:
        raise click.BadParameter("a fork needs a run id of its own", param_hint="--as")
    try:
        overrides = parse_assignments(assignments)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--set") from err
    if "run_id" in overrides or "policy" in overrides:
        raise click.BadParameter("run_id and policy are the fork's own", param_hint="--set")
    if follow and restream:
        raise click.BadParameter(
            "a restream reads RUN's raw topic once: it cannot follow a running run",
            param_hint="--follow",
        )
    if "streams" in overrides and not restream:
        raise click.BadParameter(
            "a fork trains RUN's scored groups: stream settings change them only with --restream",
            param_hint="--set",
        )
    sources: ConfigSources = ctx.meta[CONFIG_SOURCES]
    recorded = sources.resolve(run_id=run)
    try:
        forked = forked_config(sources, recorded, overrides, new)
    except ValidationError as err:
        raise click.UsageError(f"invalid configuration for the fork:\n{err}") from err
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    following = follow_idle_s if follow else None
    sys.exit(
        run_fork(recorded, forked, assignments, from_step, to_step, restream, following, timeout_s)
    )


def forked_config(
    sources: ConfigSources, recorded: RollstreamConfig, overrides: dict[str, Any], new: str
) -> RollstreamConfig:
    """The fork's configuration: RUN's sources with ``overrides`` laid over them, except
    that a loss of another type than RUN's is the ``trainer.loss`` table given, alone (at
    that type's defaults otherwise: RUN's loss settings belong to RUN's loss). A loss
    table without a type is RUN's loss type (the profile may be what set it)."""
    from consumers.config import TrainerConfig

    trainer = overrides.get("trainer")
    loss = trainer.get("loss") if isinstance(trainer, dict) else None
    if not isinstance(loss, dict):
        return sources.resolve(**overrides, run_id=new)
    if loss.setdefault("type", recorded.trainer.loss.type) == recorded.trainer.loss.type:
        return sources.resolve(**overrides, run_id=new)  # RUN's loss, some values changed
    rest = {**overrides, "trainer": {k: v for k, v in trainer.items() if k != "loss"}}
    forked = sources.resolve(**rest, run_id=new)
    section = TrainerConfig.model_validate({**forked.trainer.model_dump(), "loss": loss})
    return forked.model_copy(update={"trainer": section})


def run_fork(
    recorded: RollstreamConfig,
    forked: RollstreamConfig,
    assignments: tuple[str, ...],
    from_step: int,
    to_step: int | None,
    restream: bool,
    follow_idle_s: float | None,
    timeout_s: float,
) -> int:
    """Plan the fork from RUN's ledger, claim its home, restream if asked, train (following
    RUN while its ledger grows, given ``follow_idle_s``), compare the versions."""
    from consumers.checkpoint import CheckpointManager, TrainingLedger
    from consumers.config import checkpoint_dir, ledger_path, trainer_home
    from consumers.fork import ForkError, ForkPlan, ForkTrainer, LedgerFollowing
    from infra.services import Services
    from rollstream.config import role_config
    from rollstream.fork_restream import restream_topic

    run, new = recorded.run_id, forked.run_id
    run_ledger = ledger_path(recorded, recorded.trainer)
    scored = recorded.trainer.topics.scored
    try:
        plan = ForkPlan.of_ledger(
            run,
            restream_topic(scored, new) if restream else scored,
            TrainingLedger.read_steps(run_ledger),
            from_step,
            to_step,
            partial=restream,
            following=follow_idle_s is not None,
        )
    except ForkError as err:
        raise click.ClickException(f"{err} (ledger {run_ledger})") from None
    home = trainer_home(forked.state_dir, new, forked.policy)
    follow = follow_idle_s is not None
    last = to_step if follow else plan.to_step
    fresh = claim_home(
        home,
        fork_manifest(run, new, forked.policy, from_step, last, assignments, restream, follow),
    )
    shared, trainer = role_config(forked, "trainer", {"max_steps": last})
    trainer = trainer.model_copy(
        update={
            "checkpoint": trainer.checkpoint.model_copy(update={"dir": home / "checkpoints"}),
            "ledger_file": home / "ledger.jsonl",
            "metrics_file": home / "metrics.jsonl",
            "publish": trainer.publish.model_copy(update={"announce": False}),
        }
    )
    if fresh and from_step:
        try:
            CheckpointManager(trainer.checkpoint).adopt(
                checkpoint_dir(recorded, recorded.trainer), from_step
            )
        except FileNotFoundError as err:
            shutil.rmtree(home)  # claimed just now: nothing of the fork's is lost
            raise click.ClickException(str(err)) from None
        TrainingLedger(home / "ledger.jsonl").append(
            [s for s in TrainingLedger.read_steps(run_ledger) if s.step <= from_step]
        )
    services = Services(shared).resolved()
    if restream:
        try:
            restream_once(recorded, forked, services.kafka.client_config(), home, timeout_s)
        except click.ClickException:
            if fresh:
                shutil.rmtree(home)  # claimed just now: nothing of the fork's is lost
            raise
    following = LedgerFollowing(run_ledger, follow_idle_s) if follow_idle_s is not None else None
    runner = ForkTrainer(services, trainer, plan, read_timeout_s=timeout_s, following=following)
    runner.install_signal_handlers()
    try:
        summary = runner.run()
    except ForkError as err:
        raise click.ClickException(str(err)) from None
    click.echo(
        f"fork {new} of {run}: at step {summary.step} ({summary.steps_this_run} this run), "
        f"published {len(summary.published)} versions",
        err=True,
    )
    pairs = compare_versions(forked, run, new)
    same = [v for v, theirs, ours in pairs if theirs == ours]
    differ = [v for v, theirs, ours in pairs if theirs != ours]
    click.echo(
        f"versions held by both: {len(pairs)}; identical to {run}'s: {len(same)}; "
        f"different: {len(differ)}" + (f" (first {differ[0]})" if differ else "")
    )
    return 0


RESTREAM_FILE = "restream.json"


def restream_once(
    recorded: RollstreamConfig,
    forked: RollstreamConfig,
    client_config: dict[str, str],
    home: Path,
    timeout_s: float,
) -> None:
    """Restream RUN's raw topic into the fork's scored topic, unless an earlier run of
    this fork did (``restream.json`` in its home, written once the topic is committed)."""
    import dataclasses

    from confluent_kafka import KafkaException

    from core.topic_reader import ReadStalled
    from rollstream.fork_restream import restream

    marker = home / RESTREAM_FILE
    if marker.is_file():
        click.echo(f"restreamed before: {orjson.loads(marker.read_bytes())['topic']}", err=True)
        return
    try:
        result = restream(recorded, forked, client_config, timeout_s)
    except (ReadStalled, KafkaException, ValueError) as err:
        raise click.ClickException(f"cannot restream {recorded.run_id}: {err}") from None
    marker.write_bytes(orjson.dumps(dataclasses.asdict(result), option=orjson.OPT_INDENT_2))
    click.echo(result.summary(), err=True)
