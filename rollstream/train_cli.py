"""``rollstream train`` and ``python -m consumers``: run the trainer.

Thin on purpose: the config is parsed and validated (``--dry-run`` prints it) before
torch or DeepSpeed are imported. The trainer section is ``[trainer]`` in the rollstream
TOML (``consumers.config.TrainerConfig``); ``--set trainer.engine.lr=1e-4`` overrides one
value (the right-hand side is read as a TOML value, else as a string).
"""

from __future__ import annotations

import logging
import sys
import tomllib
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from consumers.config import TrainerConfig
from core.config import WeightsConfig
from rollstream.config import RollstreamConfig, load_config


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], assignments: tuple[str, ...]) -> dict[str, Any]:
    """``data`` with each ``a.b.c=value`` assignment applied (nested dicts created)."""
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {assignment!r}", param_hint="--set")
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise click.BadParameter(f"{key}: {part} is not a table", param_hint="--set")
        node[leaf] = _parse_value(value.strip())
    return data


def load_sections(
    path: Path | None, assignments: tuple[str, ...] = ()
) -> tuple[RollstreamConfig, TrainerConfig, WeightsConfig]:
    """The shared config with its trainer and weights sections.

    Precedence: the TOML file < ``ROLLSTREAM_*`` variables < ``--set`` assignments.
    """
    config = load_config(path, **apply_overrides({}, assignments))
    return config, config.trainer, config.weights


def run_trainer(config: RollstreamConfig, trainer: TrainerConfig, weights: WeightsConfig) -> int:
    """Resolve embedded services, build the trainer, run it to the end."""
    from consumers.trainer import Trainer, TrainerSettings
    from infra.services import Services

    resolved = Services(config).resolved()
    settings = TrainerSettings(
        run_id=resolved.run_id,
        kafka=resolved.kafka.client_config(),
        trainer=trainer,
        s3=resolved.s3,
        weights=weights,
        cache_dir=resolved.cache_dir,
        state_dir=resolved.state_dir,
    )
    runner = Trainer(settings)
    runner.install_signal_handlers()
    summary = runner.run()
    click.echo(
        f"stopped at step {summary.step}: {summary.steps_this_run} steps this run, "
        f"{summary.trained} trajectories, {summary.dead_letters} dead letters, "
        f"{summary.checkpoints} checkpoints, published {len(summary.published)} versions",
        err=True,
    )
    return 0


_SET_HELP = "Override one value, e.g. --set trainer.engine.lr=1e-4 (repeatable)."


@click.command("train")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
@click.option("--max-steps", type=int, help="Stop after this many optimiser steps in total.")
@click.option("--dry-run", is_flag=True, help="Print the merged trainer config and exit.")
@click.pass_context
def train(
    ctx: click.Context, assignments: tuple[str, ...], max_steps: int | None, dry_run: bool
) -> None:
    """Train on rollouts.scored and publish versions (the trainer role)."""
    config: RollstreamConfig = ctx.obj
    trainer, weights = config.trainer, config.weights
    if assignments:
        data = apply_overrides({"trainer": trainer.model_dump(mode="json")}, assignments)
        trainer = _validated(data["trainer"])
    _finish(config, trainer, weights, max_steps, dry_run)


def _validated(raw: dict[str, Any]) -> TrainerConfig:
    try:
        return TrainerConfig.model_validate(raw)
    except ValidationError as err:
        raise click.UsageError(f"invalid trainer configuration:\n{err}") from err


def _finish(
    config: RollstreamConfig,
    trainer: TrainerConfig,
    weights: WeightsConfig,
    max_steps: int | None,
    dry_run: bool,
) -> None:
    if max_steps is not None:
        trainer = trainer.model_copy(update={"max_steps": max_steps})
        trainer = _validated(trainer.model_dump(mode="json"))
    if dry_run:
        click.echo(trainer.model_dump_json(indent=2))
        return
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sys.exit(run_trainer(config, trainer, weights))
