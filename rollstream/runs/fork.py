"""``rollstream fork RUN --as NEW``: train a run again from its log, under a new run id.

What the command takes, writes and compares is its help (the ``fork`` command's
docstring); how the fork's trainer gets its data: ``consumers.fork``; ``--restream``:
``rollstream.runs.restream``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson
from pydantic import ValidationError

from rollstream.config.run_files import run_sources
from rollstream.config.settings import (
    CONFIG_SOURCES,
    ConfigSources,
    RollstreamConfig,
    parse_assignments,
)

if TYPE_CHECKING:
    from consumers.fork import ForkPlan, ForkTrainer

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

    s3 = Services(config).running(kafka=False).s3
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
    """Whether ``home`` is free for the fork (True) or already its own (False: a resume);
    ``ClickException`` when it belongs to another fork. Writes nothing: ``write_claim``
    does, once everything the fork needs has been checked."""
    existing = read_fork(home)
    if existing is None:
        return True
    older = {"restream": False, "follow": False}  # fork.json of forks made before these
    kept = older | {k: v for k, v in existing.items() if k != "created"}
    if kept != manifest:
        raise click.ClickException(
            f"{manifest['fork']} is already a fork of {existing['run']} with other "
            f"settings ({home / FORK_FILE}); choose another name"
        )
    return False


def write_claim(home: Path, manifest: dict[str, Any]) -> None:
    """Make ``home`` the fork's: its ``fork.json``."""
    home.mkdir(parents=True, exist_ok=True)
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    (home / FORK_FILE).write_bytes(
        orjson.dumps({**manifest, "created": created}, option=orjson.OPT_INDENT_2)
    )


def traces_of(config: RollstreamConfig, run: str) -> list[str]:
    """What shows that ``run`` is a run here: its weight lineage in the store, its ``up``
    run directory, its trainer's home under the state dir and, when ``config`` is that
    run's own, the ledger and checkpoints it names. Empty: no run of that name."""
    from consumers.config import checkpoint_dir, ledger_path, trainer_home
    from rollstream.config.run_files import default_run_dir

    found = []
    versions = stored_versions(config, run)
    if versions:
        found.append(f"versions {versions[0]}..{versions[-1]} in the weight store")
    places = [
        default_run_dir(config.state_dir, run),
        trainer_home(config.state_dir, run, config.policy),
    ]
    if config.run_id == run:
        places += [ledger_path(config, config.trainer), checkpoint_dir(config, config.trainer)]
    for place in places:
        if place.is_file() or (place.is_dir() and any(place.iterdir())):
            found.append(str(place))
    return found


def refuse_taken(config: RollstreamConfig, new: str) -> None:
    """``ClickException`` when ``new`` already names a run (a fork would add its versions
    to that run's lineage)."""
    traces = traces_of(config, new)
    if traces:
        raise click.ClickException(
            f"{new} is a run of its own ({'; '.join(traces)}): choose another name"
        )


def recorded_ledger(config: RollstreamConfig, recorded: RollstreamConfig, following: bool) -> Path:
    """RUN's ledger, once RUN is known to be a run this config can fork: one that exists,
    no fork, whose files are where ``recorded`` says (a config names its own run's), with a
    ledger (unless ``following``: a run still training may have none yet)."""
    from consumers.config import ledger_path, trainer_home
    from rollstream.config.run_files import RUN_CONFIG, default_run_dir

    run = recorded.run_id
    forked = read_fork(trainer_home(config.state_dir, run, config.policy))
    if forked is not None:
        raise click.ClickException(
            f"{run} is a fork of {forked['run']}: fork {forked['run']} instead, with "
            f"{run}'s --set ({' '.join(forked.get('set', [])) or 'none'}) and yours"
        )
    if not traces_of(config, run):
        raise click.ClickException(
            f"no run {run!r}: no weight lineage, run directory, ledger or checkpoints of that name"
        )
    named = recorded.trainer.ledger_file is not None or recorded.trainer.checkpoint.dir is not None
    own = default_run_dir(config.state_dir, run) / RUN_CONFIG  # an `up` run's
    if config.run_id != run and (named or own.is_file()):
        where = own if own.is_file() else f"<run_dir>/{RUN_CONFIG}, as `up` writes it"
        raise click.ClickException(
            f"this config is run {config.run_id}'s, not {run}'s (it names where that run "
            f"keeps its ledger and checkpoints): fork {run} with --config {where}"
        )
    ledger = ledger_path(recorded, recorded.trainer)
    if not ledger.is_file() and not following:
        raise click.ClickException(f"run {run} has no ledger at {ledger}: it trained no step")
    return ledger


@dataclasses.dataclass(frozen=True)
class ForkRequest:
    """What ``rollstream fork`` was asked to do, past RUN and NEW: the settings changed
    (``--set``), the steps, whether the groups are made again, whether it follows a run
    still training (and how long an idle ledger is waited for), the topic read timeout."""

    assignments: tuple[str, ...]
    from_step: int
    to_step: int | None
    restream: bool
    follow: bool
    follow_idle_s: float
    timeout_s: float

    @property
    def following(self) -> float | None:
        """How long RUN's ledger may stay idle while the fork follows it; None: no follow."""
        return self.follow_idle_s if self.follow else None


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
def fork(ctx: click.Context, run: str, new: str | None, show_list: bool, **options: Any) -> None:
    """Train RUN again from its recorded scored groups, step by step as RUN's trainer
    did, as run NEW, with this command's configuration: RUN's own config file, --set laid
    over it (the one thing changed). It starts from RUN's initial weights
    ([trainer.model]) or, with --from-step N, from RUN's checkpoint of step N (optimiser
    state included); with --restream the groups are made again first.

    RUN must be a run `up` made (its config is found by its id under the state dir), the
    run this config file is for, or one with the default file locations, not a fork; NEW
    must name no run yet (no weight lineage, run directory, ledger or checkpoints). A fork
    that cannot be made, or fails before it publishes a version, writes nothing.

    Everything the fork writes is its own: under <state_dir>/trainer/NEW/, fork.json (what
    it forks, with which settings), checkpoints/, ledger.jsonl and metrics.jsonl (where
    `rollstream report NEW` finds them); in S3, its weight lineage under NEW (versions not
    announced). Run the same command again to resume a fork that was stopped (it exits 1
    then) or killed; the same name with other settings is refused.

    At the end it compares the fork's versions with RUN's, each by its manifest's
    state_sha256. A control fork (no --set, no --restream) that differs at any version
    exits 1 and says why: only a run trained with [trainer.engine] deterministic = true
    (off by default, in `up`'s runs too), forked on the same kind of machine and software
    and on one rank as it trained, has bit-identical control forks."""
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
    asked = ForkRequest(**options)
    assignments, restream = asked.assignments, asked.restream
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
    if asked.follow and restream:
        raise click.BadParameter(
            "a restream reads RUN's raw topic once: it cannot follow a running run",
            param_hint="--follow",
        )
    if "streams" in overrides and not restream:
        raise click.BadParameter(
            "a fork trains RUN's scored groups: stream settings change them only with --restream",
            param_hint="--set",
        )
    sources = run_sources(ctx.meta[CONFIG_SOURCES], config, run)
    if sources is not ctx.meta[CONFIG_SOURCES]:  # a run `up` made: its own file
        config = sources.resolve()
    recorded = sources.resolve(run_id=run)
    try:
        forked = forked_config(sources, recorded, overrides, new)
    except ValidationError as err:
        raise click.UsageError(f"invalid configuration for the fork:\n{err}") from err
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sys.exit(run_fork(config, recorded, forked, asked))


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
    config: RollstreamConfig,
    recorded: RollstreamConfig,
    forked: RollstreamConfig,
    asked: ForkRequest,
) -> int:
    """Check RUN, NEW and the plan (RUN's ledger) before writing anything, claim the
    fork's home, then train (``ForkJob``) and compare the versions. A fresh fork that
    fails before publishing a version leaves nothing behind."""
    assignments, from_step, to_step = asked.assignments, asked.from_step, asked.to_step
    restream, follow_idle_s, timeout_s = asked.restream, asked.following, asked.timeout_s
    from consumers.checkpoint import TrainingLedger
    from consumers.config import trainer_home
    from consumers.fork import ForkError, ForkPlan
    from rollstream.runs.restream import restream_topic

    run, new = recorded.run_id, forked.run_id
    run_ledger = recorded_ledger(config, recorded, follow_idle_s is not None)
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
        plan.check_micro_batches(forked.trainer.engine.grad_accum_steps)
    except ForkError as err:
        raise click.ClickException(f"{err} (ledger {run_ledger})") from None
    home = trainer_home(forked.state_dir, new, forked.policy)
    follow = follow_idle_s is not None
    last = to_step if follow else plan.to_step
    manifest = fork_manifest(
        run, new, forked.policy, from_step, last, assignments, restream, follow
    )
    fresh = claim_home(home, manifest)
    if fresh:
        refuse_taken(config, new)
        write_claim(home, manifest)
    job = ForkJob(recorded, forked, plan, run_ledger, home, last, restream, follow_idle_s)
    try:
        runner = job.train(fresh, timeout_s)
    except BaseException:
        if fresh and not stored_versions(forked, new):
            shutil.rmtree(home, ignore_errors=True)  # claimed just now: nothing of the fork's
        raise
    summary = runner.summary
    click.echo(
        f"fork {new} of {run}: at step {summary.step} ({summary.steps_this_run} this run), "
        f"published {len(summary.published)} versions",
        err=True,
    )
    if runner.stop_event.is_set():
        raise click.ClickException(
            f"fork {new} was stopped at step {summary.step}: run the same command again to go on"
        )
    pairs = compare_versions(forked, run, new)
    same = [v for v, theirs, ours in pairs if theirs == ours]
    differ = [v for v, theirs, ours in pairs if theirs != ours]
    click.echo(
        f"versions held by both: {len(pairs)}; identical to {run}'s: {len(same)}; "
        f"different: {len(differ)}" + (f" (first {differ[0]})" if differ else "")
    )
    if differ and not assignments and not restream:
        raise click.ClickException(control_differs(recorded, differ[0]))
    return 0


def control_differs(recorded: RollstreamConfig, version: int) -> str:
    """Why a control fork (nothing changed) can differ from its run at ``version``."""
    head = f"this control fork differs from {recorded.run_id} from version {version} on: "
    if not recorded.trainer.engine.deterministic:
        return head + (
            f"{recorded.run_id}'s trainer ran without [trainer.engine] deterministic, so its "
            "floating-point sums may come out in another order; only a run trained with "
            "deterministic = true has bit-identical control forks"
        )
    return head + (
        "the fork trained with other settings than the run (did its config change?), on "
        "another kind of machine or software, or the run trained on more than one rank"
    )


def stored_versions(config: RollstreamConfig, run: str) -> list[int]:
    """The versions of ``run``'s weight lineage in the store."""
    from infra.services import Services
    from weights.store import WeightStore

    s3 = Services(config).running(kafka=False).s3  # a stopped embedded store: one line
    return WeightStore.from_config(s3, run, config.policy).versions()


@dataclasses.dataclass(frozen=True)
class ForkJob:
    """A checked fork, its home claimed: what ``train`` needs. ``last``: the step it
    ends after (None: RUN's end, following it)."""

    recorded: RollstreamConfig
    forked: RollstreamConfig
    plan: ForkPlan
    run_ledger: Path
    home: Path
    last: int | None
    restream: bool
    follow_idle_s: float | None

    def train(self, fresh: bool, timeout_s: float) -> ForkTrainer:
        """Adopt RUN's checkpoint (a fresh fork from a step), restream if asked, train;
        the ``ForkTrainer`` once it has run."""
        from consumers.checkpoint import CheckpointManager, TrainingLedger
        from consumers.config import checkpoint_dir
        from consumers.fork import ForkError, ForkTrainer, LedgerFollowing
        from infra.services import Services
        from rollstream.config.settings import role_config

        recorded, home, start = self.recorded, self.home, self.plan.from_step
        shared, trainer = role_config(self.forked, "trainer", {"max_steps": self.last})
        trainer = trainer.model_copy(
            update={
                "checkpoint": trainer.checkpoint.model_copy(update={"dir": home / "checkpoints"}),
                "ledger_file": home / "ledger.jsonl",
                "metrics_file": home / "metrics.jsonl",
                "publish": trainer.publish.model_copy(update={"announce": False}),
            }
        )
        if fresh and start:
            try:
                CheckpointManager(trainer.checkpoint).adopt(
                    checkpoint_dir(recorded, recorded.trainer), start
                )
            except FileNotFoundError as err:
                raise click.ClickException(str(err)) from None
            TrainingLedger(home / "ledger.jsonl").append(
                [s for s in TrainingLedger.read_steps(self.run_ledger) if s.step <= start]
            )
        services = Services(shared).running()
        if self.restream:
            client = services.kafka.client_config()
            restream_once(recorded, self.forked, client, home, timeout_s)
        idle_s = self.follow_idle_s
        following = LedgerFollowing(self.run_ledger, idle_s) if idle_s is not None else None
        runner = ForkTrainer(
            services, trainer, self.plan, read_timeout_s=timeout_s, following=following
        )
        runner.install_signal_handlers()
        try:
            runner.run()
        except ForkError as err:
            raise click.ClickException(str(err)) from None
        return runner


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
    from confluent_kafka import KafkaException

    from core.topic_reader import ReadStalled
    from rollstream.runs.restream import restream

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
