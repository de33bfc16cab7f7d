"""The whole configuration (``RollstreamConfig``): the shared sections of ``core.config``
plus each role's own section and ``[up]``. Pydantic only, no torch, so every entry point
validates its configuration before importing anything heavy. Unknown keys are errors.

Sources, earlier ones winning (``load_config``): explicit overrides (``--set``, ``--state-dir``),
``ROLLSTREAM_*`` variables (``ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS=...``, nested with ``__``),
the widely used ``KAFKA_BOOTSTRAP_SERVERS`` and ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, the TOML file (``--config``), the defaults. S3 credentials come from
the standard AWS chain unless the store is the embedded one.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field

from consumers.config import TrainerConfig
from core.config import SharedConfig, StrictModel, merge_tables, settings_from_sources
from producers.config import ProducersConfig
from rollstream.profiles import ProfileConfig, profile_sections
from schemas.topics import (
    POLICY_VERSIONS,
    PROMPTS_STATS,
    ROLES,
    ROLLOUTS_DLQ,
    ROLLOUTS_FILTERED,
    ROLLOUTS_RAW,
    ROLLOUTS_SCORED,
    ROLLOUTS_STALE,
    TopicSpec,
)
from streams.config import StreamsConfig


class UpConfig(StrictModel):
    """``rollstream up``: the whole pipeline on one machine. What the roles learn with comes
    from ``[profile]`` (``rollstream.profiles``); this section only says how long ``up``
    runs and how it treats its processes."""

    max_steps: int = Field(default=150, ge=1, description="Stop after this many trainer steps.")
    producers: int = Field(
        default=1, ge=1, description="Producers, each with its own engine (its own weights)."
    )
    stream_workers: int = Field(
        default=1, ge=1, description="Stream workers sharing the raw topic's partitions."
    )
    trainer_ranks: int = Field(
        default=1,
        ge=1,
        description="Data-parallel trainer ranks, started by torch's launcher (torchrun).",
    )
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
    profile: ProfileConfig = Field(
        default_factory=ProfileConfig,
        description="[profile]: the settings every role derives (model, dtypes, lr, loss, "
        "batch, admission credit), under what the file sets explicitly.",
    )
    up: UpConfig = Field(
        default_factory=UpConfig, description="[up]: `rollstream up` (all roles on one machine)."
    )

    def topic_specs(self) -> list[TopicSpec]:
        """Every topic of this run under the names its sections give (tests and shared
        clusters rename them), with the partitions and configs of ``schemas.topics``."""
        names = [
            (ROLLOUTS_RAW, {self.producers.rollout.topic, self.streams.topics.raw}),
            (ROLLOUTS_SCORED, {self.streams.topics.scored, self.trainer.topics.scored}),
            (ROLLOUTS_STALE, {self.streams.topics.stale}),
            (ROLLOUTS_DLQ, {self.streams.topics.dlq, self.trainer.topics.dlq}),
            (ROLLOUTS_FILTERED, {self.streams.topics.filtered}),
            (
                PROMPTS_STATS,
                {self.streams.topics.prompt_stats, self.producers.rollout.curriculum.topic},
            ),
            (
                POLICY_VERSIONS,
                {self.weights.topic, self.streams.topics.versions, self.trainer.topics.versions},
            ),
            (ROLES, {self.presence.topic}),
        ]
        return [
            dataclasses.replace(spec, name=name) for spec, given in names for name in sorted(given)
        ]

    def role_section(self, role: str) -> dict[str, Any]:
        """The effective settings one role runs with: the shared sections and its own."""
        own = {"engine": "producers", "producer": "producers", "stream": "streams"}.get(role, role)
        if own not in ("producers", "streams", "trainer"):
            raise ValueError(f"unknown role {role!r}: producers, streams or trainer")
        shared = (
            "run_id",
            "state_dir",
            "cache_dir",
            "kafka",
            "s3",
            "weights",
            "presence",
            "profile",
        )
        return self.model_dump(mode="json", include={*shared, own})


def load_config(path: Path | None = None, **overrides: Any) -> RollstreamConfig:
    """The whole config from its sources (``core.config.settings_from_sources``): explicit
    ``overrides`` > ``ROLLSTREAM_*`` variables > ``KAFKA_BOOTSTRAP_SERVERS`` /
    ``AWS_ENDPOINT_URL[_S3]`` > the TOML file > the ``[profile]``'s settings > defaults."""
    return with_profile(settings_from_sources(RollstreamConfig, path, overrides))


def with_profile(config: RollstreamConfig) -> RollstreamConfig:
    """``config`` with its profile's role settings under the values set explicitly."""
    explicit = config.model_dump(exclude_unset=True)
    return RollstreamConfig.model_validate(merge_tables(profile_sections(config.profile), explicit))


def parse_assignments(assignments: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Nested overrides from ``a.b.c=value`` assignments (``--set``); the right-hand side
    is read as a TOML value, else as a string. ``ValueError`` names a malformed one."""
    data: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {assignment!r}")
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key}: {part} is not a table")
        node[leaf] = _toml_value(value.strip())
    return data


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
