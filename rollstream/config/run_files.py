"""Where a run's files are: a run made by ``rollstream up`` keeps its own config.

``up`` writes ``<state_dir>/runs/<RUN>/rollstream.toml`` (the config its roles ran with:
the trainer's metrics, ledger and checkpoints, the eval rows, all in the run directory).
A command given the user's own file and a run id reads that file's paths instead, so
``report``, ``export-dataset``, ``fork`` and the like find the run without being pointed
at them.
"""

from __future__ import annotations

from pathlib import Path

from core.config import merge_tables
from rollstream.config.settings import ConfigSources, RollstreamConfig

RUN_CONFIG = "rollstream.toml"
"""The file in a run directory holding the config ``up`` ran the run with."""


def default_run_dir(state_dir: Path, run_id: str) -> Path:
    """``<state_dir>/runs/<run_id>``: where ``up`` keeps a run's config, logs, ledger and
    checkpoints unless ``--run-dir`` says otherwise."""
    return state_dir / "runs" / run_id


def run_sources(sources: ConfigSources, config: RollstreamConfig, run: str) -> ConfigSources:
    """The sources of the config ``up`` ran ``run`` with: its run directory's file, with
    this command's overrides (``--set``, ``--state-dir``: ``config``'s state dir) and
    policy over it, when ``up`` made ``run``; else ``sources`` as they are."""
    path = (default_run_dir(config.state_dir, run) / RUN_CONFIG).resolve()
    if not path.is_file() or (sources.path is not None and sources.path.resolve() == path):
        return sources
    overrides = merge_tables({"state_dir": str(config.state_dir)}, dict(sources.overrides))
    return ConfigSources(path, overrides, sources.policy or config.policy or None)


def run_config(config: RollstreamConfig, run: str) -> RollstreamConfig:
    """The config ``up`` ran ``run`` with, seen as ``config``'s policy and state dir, when
    ``up`` made it; else ``config`` itself."""
    sources = run_sources(ConfigSources(), config, run)
    return config if sources.path is None else sources.resolve()
