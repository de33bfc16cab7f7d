"""Typed configuration shared by every role.

One light module (pydantic only, no torch) so that every entry point can parse and
validate its configuration before importing anything heavy. Unknown keys are errors.

Sources, later ones winning: defaults < TOML file (``--config``) < environment
(``ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS=...``, nested with ``__``). A few widely used
variables are honoured too: ``KAFKA_BOOTSTRAP_SERVERS`` and ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``. S3 credentials come from the standard AWS chain unless the store
is the embedded one.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from consumers.config import TrainerConfig
from core.config import SharedConfig, StrictModel, merge_tables
from producers.config import ProducersConfig
from streams.config import StreamsConfig


class UpConfig(StrictModel):
    """``rollstream up``: the whole pipeline on one machine. The role sections are derived
    from these keys, under whatever the role sections of the file set explicitly."""

    sync: bool = Field(
        default=False,
        description="Synchronous baseline: staleness window 0, generation waits for each "
        "update (same code as async, only the derived config differs).",
    )
    staleness_window: int = Field(
        default=2,
        ge=0,
        description="Async mode: how many versions generation may run ahead of training "
        "(producers' admission credit and the streams' staleness filter).",
    )
    model: Literal["tiny", "smollm2-135m"] = Field(
        default="tiny",
        description="tiny: the ~132k-parameter Llama built from a config; smollm2-135m: "
        "SmolLM2-135M-Instruct from the cached GGUF.",
    )
    task: str | None = Field(
        default=None,
        description="Task name; empty: copy-first-digit-twice (tiny) or arithmetic (smollm2).",
    )
    groups_per_step: int | None = Field(
        default=None,
        ge=1,
        description="GRPO groups per optimiser step; empty: 16 (tiny) or 4 (smollm2).",
    )
    max_steps: int = Field(default=150, ge=1, description="Stop after this many trainer steps.")
    stop_timeout_s: float = Field(
        default=30.0, gt=0, description="SIGTERM grace per role before SIGKILL."
    )
    ready_timeout_s: float = Field(
        default=300.0, gt=0, description="Longest wait for a role to become ready."
    )
    restarts: int = Field(
        default=0, ge=0, description="Restart a role that exits unexpectedly this many times."
    )
    pin_cores: bool = Field(
        default=False,
        description="Pin roles to CPU cores (os.sched_setaffinity): trainer and streams on "
        "the last core, engine and producer on the others, as if on separate devices.",
    )


class RollstreamConfig(SharedConfig):
    """The whole configuration: one file for every role (the shared sections, then each
    role's own)."""

    producers: ProducersConfig = Field(
        default_factory=ProducersConfig, description="[producers]: engine and rollout worker."
    )
    streams: StreamsConfig = Field(
        default_factory=StreamsConfig, description="[streams]: the Faust stream processors."
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="[trainer]: the DeepSpeed trainer."
    )
    up: UpConfig = Field(
        default_factory=UpConfig, description="[up]: `rollstream up` (all roles on one machine)."
    )


def _well_known_env() -> dict[str, Any]:
    """Standard variables that users of Kafka and S3 tools already set."""
    found: dict[str, Any] = {}
    if servers := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        found.setdefault("kafka", {})["bootstrap_servers"] = servers
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        found.setdefault("s3", {})["endpoint_url"] = endpoint
    return found


def load_config(path: Path | None = None, **overrides: Any) -> RollstreamConfig:
    """Build the config from an optional TOML file, the environment and explicit overrides.

    ``ROLLSTREAM_*`` variables win over the file (pydantic-settings gives init values
    priority, so they are merged in here by hand), explicit ``overrides`` win over both.
    """
    values: dict[str, Any] = {}
    if path is not None:
        with Path(path).open("rb") as fh:
            values = tomllib.load(fh)
    values = merge_tables(values, _well_known_env())
    env_only = RollstreamConfig.model_validate({}).model_dump(exclude_unset=True)
    values = merge_tables(values, env_only)
    values = merge_tables(values, overrides)
    return RollstreamConfig.model_validate(values)
