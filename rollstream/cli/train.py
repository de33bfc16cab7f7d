"""``rollstream train`` and ``python -m consumers``: run the trainer.

Thin on purpose: the config is parsed and validated (``--dry-run`` prints it) before
torch or DeepSpeed are imported. The trainer section is ``[trainer]`` in the rollstream
TOML (``consumers.config.TrainerConfig``); ``rollstream --set trainer.engine.lr=1e-4 train``
overrides one value, as for every role.
"""

from __future__ import annotations

import logging
import sys

import click
from pydantic import ValidationError

from consumers.config import TrainerConfig
from core.config import SharedConfig
from rollstream.config.settings import RollstreamConfig, role_config


def run_trainer(shared: SharedConfig, trainer: TrainerConfig) -> int:
    """Resolve embedded services, build the trainer, run it to the end."""
    from consumers.guards import GUARD_EXIT, GuardStop
    from consumers.trainer import Trainer
    from core.process import die_with_rank_launcher
    from infra.services import Services

    die_with_rank_launcher()
    runner = Trainer(Services(shared).running(s3=False), trainer)
    runner.install_signal_handlers()
    try:
        summary = runner.run()
    except GuardStop as stop:  # one line naming the guard; `rollstream up` shows it
        click.echo(f"GuardExit: {stop}", err=True)
        return GUARD_EXIT
    click.echo(
        f"stopped at step {summary.step}: {summary.steps_this_run} steps this run, "
        f"{summary.trained} trajectories, {summary.dead_letters} dead letters, "
        f"{summary.stale_groups} stale groups routed, "
        f"{summary.checkpoints} checkpoints, published {len(summary.published)} versions",
        err=True,
    )
    return 0


@click.command("train")
@click.option(
    "--max-steps", type=int, help="Stop after this many trainer steps (scored batches) in total."
)
@click.option("--dry-run", is_flag=True, help="Print the merged trainer config and exit.")
@click.pass_obj
def train(config: RollstreamConfig, max_steps: int | None, dry_run: bool) -> None:
    """Train on rollouts.scored and publish versions (the trainer role)."""
    config.require_policy()
    try:
        shared, trainer = role_config(config, "trainer", {"max_steps": max_steps})
    except ValidationError as err:
        raise click.UsageError(f"invalid trainer configuration:\n{err}") from err
    if dry_run:
        click.echo(trainer.model_dump_json(indent=2))
        return
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sys.exit(run_trainer(shared, trainer))
