"""Where a run's files are: a run made by ``rollstream up`` keeps its own config.

``up`` writes ``<state_dir>/runs/<RUN>/rollstream.toml`` (the config its roles ran with:
the trainer's metrics, ledger and checkpoints, the eval rows, all in the run directory).
A command given the user's own file and a run id reads that file's paths instead, so
``report``, ``export-dataset`` and the like find the run without being pointed at them.
"""

from __future__ import annotations

from rollstream.config import RollstreamConfig, load_config
from rollstream.up_plan import RUN_CONFIG, default_run_dir


def run_config(config: RollstreamConfig, run: str) -> RollstreamConfig:
    """The config ``up`` ran ``run`` with, seen as ``config``'s policy and state dir, when
    ``up`` made it; else ``config`` itself."""
    path = default_run_dir(config.state_dir, run) / RUN_CONFIG
    if not path.is_file():
        return config
    return load_config(path, policy=config.policy, state_dir=str(config.state_dir))
