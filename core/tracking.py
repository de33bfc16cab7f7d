"""Experiment tracking: the trainer's and the evaluator's metric rows, also sent to
TensorBoard, Weights & Biases and MLflow.

The JSONL metrics files stay the record (``report`` and the live display read them);
tracking is a copy for the tools a team already watches. Each backend is the library's own
client, imported only when configured. A backend that fails while the run goes on is
logged once and dropped: a dashboard outage never stops training.

A role's tracked run is named ``<run_id>-<role>`` (``trainer``, ``eval``, or with a
policy ``eval-<policy>``) and resumes under that name after a restart: W&B by run id,
MLflow by finding the run of that name in its store, TensorBoard by appending to the
same log directory.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from core.config import SharedConfig, TrackingConfig

logger = logging.getLogger(__name__)


class _Backend(Protocol):
    name: str

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, directory: Path, run: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory / "tensorboard" / run))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, directory: Path, run: str, config: TrackingConfig) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.project,
            name=run,
            id=re.sub(r"[^A-Za-z0-9_-]", "-", run),
            resume="allow",
            dir=str(directory),
            mode=config.wandb_mode,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        # a restarted trainer logs its last steps again: W&B keeps steps monotonic
        if step >= self.run.step:
            self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    name = "mlflow"

    def __init__(self, directory: Path, run: str, config: TrackingConfig) -> None:
        from mlflow.tracking import MlflowClient

        directory.mkdir(parents=True, exist_ok=True)
        uri = config.mlflow_tracking_uri or f"sqlite:///{(directory / 'mlflow.db').absolute()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(config.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(config.project)
        )
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`mlflow.runName` = '{run}'", max_results=1
        )
        self.run_id = (
            found[0].info.run_id
            if found
            else self.client.create_run(experiment_id, run_name=run).info.run_id
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=entries)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow takes letters, digits, ``_ - . / :`` and spaces in a metric name."""
    return re.sub(r"[^A-Za-z0-9_\-./: ]", "_", key)


class Tracker:
    """Sends metric rows to the configured backends; ``log`` never raises."""

    def __init__(self, backends: list[_Backend]) -> None:
        self._backends = backends

    @classmethod
    def for_role(cls, shared: SharedConfig, role: str) -> Tracker:
        """The tracker of ``role`` (``trainer``, ``eval``) in this process's run and
        policy: its tracked run is ``<run_id>-<role>[-<policy>]``."""
        name = f"{role}-{shared.policy}" if shared.policy else role
        return cls.open(shared.tracking, shared.state_dir, shared.run_id, name)

    @classmethod
    def open(cls, config: TrackingConfig, state_dir: Path, run_id: str, role: str) -> Tracker:
        """Start every configured backend for this role's run. A backend that cannot
        start is a configuration error: raised here, before any work."""
        directory = config.directory(state_dir, run_id)
        run = f"{run_id}-{role}"
        backends: list[_Backend] = []
        for name in dict.fromkeys(config.backends):
            if name == "tensorboard":
                backends.append(_TensorBoard(directory, run))
            elif name == "wandb":
                backends.append(_Wandb(directory, run, config))
            else:
                backends.append(_Mlflow(directory, run, config))
        if backends:
            logger.info("tracking %s as %s in %s", ", ".join(config.backends), run, directory)
        return cls(backends)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One row: its finite numbers, at ``step``."""
        numbers = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        for backend in list(self._backends):
            try:
                backend.log(numbers, step)
            except Exception:
                logger.exception("tracking to %s failed; it is dropped for this run", backend.name)
                self._backends.remove(backend)

    def close(self) -> None:
        for backend in self._backends:
            try:
                backend.close()
            except Exception:
                logger.exception("closing %s failed", backend.name)
        self._backends = []
