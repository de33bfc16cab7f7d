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

from pydantic import Field, ValidationError, field_validator

from consumers.config import TrainerConfig
from core.config import (
    ConfigurationError,
    SharedConfig,
    StrictModel,
    merge_tables,
    settings_from_sources,
)
from producers.config import ProducersConfig
from rollstream.policies import check_policy_tables, policy_values
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
    policies: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="[policies.<name>]: the policies of a multi-policy run, each a table of "
        "overrides for the roles serving it (rollstream.policies); empty: one policy.",
    )

    @field_validator("policies")
    @classmethod
    def _policies_are_well_formed(cls, policies: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return check_policy_tables(policies)

    @property
    def policy_names(self) -> list[str]:
        """The run's policies in order of name; ``[""]`` for a single-policy run."""
        return sorted(self.policies) or [""]

    def require_policy(self) -> None:
        """A role of a multi-policy run serves one policy: refuse to start without one."""
        if self.policies and not self.policy:
            raise ConfigurationError(
                f"this run has several policies ({', '.join(sorted(self.policies))}): "
                "name the one to serve with `rollstream --policy NAME ...`"
            )

    def run_topic_specs(self) -> list[TopicSpec]:
        """Every topic of the run: of each policy's view in a multi-policy run (the root's
        names are then unused), else ``topic_specs``."""
        if not self.policies or self.policy:
            return self.topic_specs()
        return [spec for name in sorted(self.policies) for spec in self.view(name).topic_specs()]

    def view(self, policy: str) -> RollstreamConfig:
        """``policy``'s view of this (root) config. Built from the settings already
        resolved, so prefer ``load_config(policy=...)``, which lets a policy's own
        ``profile`` derive its roles' settings; names and tables come out the same."""
        if self.policy:
            raise ValueError(f"this is already policy {self.policy!r}'s view")
        return policy_view(self, policy)

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


def load_config(
    path: Path | None = None, *, policy: str | None = None, **overrides: Any
) -> RollstreamConfig:
    """The whole config from its sources (``core.config.settings_from_sources``): explicit
    ``overrides`` > ``ROLLSTREAM_*`` variables > ``KAFKA_BOOTSTRAP_SERVERS`` /
    ``AWS_ENDPOINT_URL[_S3]`` > the TOML file > the ``[profile]``'s settings > defaults.

    ``policy`` picks one policy of a multi-policy run: its ``[policies.<name>]`` table is
    laid over the sources and its names are renamed into its namespace
    (``rollstream.policies``) before the profile derives the roles' settings, so a policy
    with its own ``profile.model`` gets that model's settings everywhere. Every policy's
    view is built once here, so a bad table fails whichever role starts first."""
    raw = settings_from_sources(RollstreamConfig, path, overrides)
    views = {name: policy_view(raw, name, overrides) for name in raw.policies}
    check_peers(views)
    policy = policy or raw.policy  # ROLLSTREAM_POLICY or `--set policy=...` name it too
    if policy:
        return views[policy] if policy in views else policy_view(raw, policy, overrides)
    return with_profile(raw)


def policy_view(
    raw: RollstreamConfig, policy: str, overrides: dict[str, Any] | None = None
) -> RollstreamConfig:
    """``policy``'s view of ``raw`` (a config before its profile is applied). Explicit
    ``overrides`` (``--set``) win over the policy's table too: a second stream worker of a
    policy gets its own port on its command line."""
    explicit = raw.model_dump(exclude_unset=True)
    values = policy_values(explicit, raw.model_dump(), raw.policies, policy)
    values = merge_tables(values, {k: v for k, v in (overrides or {}).items() if k != "policy"})
    try:
        return with_profile(RollstreamConfig.model_validate(values))
    except ValidationError as err:
        raise ConfigurationError(f"[policies.{policy}] is not valid:\n{err}") from err


def check_peers(views: dict[str, RollstreamConfig]) -> None:
    """Peers must be other policies of the run, and some policy must drive (be called by
    none): a run whose policies only call each other would start no producer."""
    called: set[str] = set()
    for name, view in views.items():
        peers = view.producers.rollout.peers
        wrong = sorted({p for p in peers if p not in views or p == name})
        if wrong:
            raise ConfigurationError(
                f"[policies.{name}] producers.rollout.peers names {', '.join(wrong)}: peers "
                f"are the run's other policies ({', '.join(sorted(set(views) - {name}))})"
            )
        called.update(peers)
    if views and called >= set(views):
        raise ConfigurationError(
            "every policy is another's peer, so none drives an episode: leave one policy "
            "out of every producers.rollout.peers"
        )


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
