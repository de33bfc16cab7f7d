"""The whole configuration (``RollstreamConfig``): the shared sections of ``core.config``
plus each role's own section and ``[up]``. Pydantic only, no torch, so every entry point
validates its configuration before importing anything heavy. Unknown keys are errors.

One path for every process: ``load_config`` is the resolver (the ``rollstream`` group
calls it once, through ``ConfigSources``), and ``role_config`` cuts what a role receives
from its result. Sources, earlier ones winning: explicit overrides (``--set``,
``--state-dir``), ``ROLLSTREAM_*`` variables (``ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS=...``,
nested with ``__``), the widely used ``KAFKA_BOOTSTRAP_SERVERS`` and
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, the TOML file (``--config``), the
``[profile]``'s settings, the defaults. S3 credentials come from the standard AWS chain
unless the store is the embedded one.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args, overload

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from consumers.config import TrainerConfig
from core.config import (
    ConfigurationError,
    RoleConfig,
    Seconds,
    SectionT,
    SharedConfig,
    StrictModel,
    merge_tables,
)
from core.config_sources import Layer, Sources, from_values, read_sources
from producers.config import ProducersConfig
from rollstream.config.policies import check_policy_tables, policy_values
from rollstream.config.profiles import ProfileConfig
from rollstream.config.shared import check_shared, derived_sections
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
    from ``[profile]`` (``rollstream.config.profiles``); this section only says how long ``up``
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
    stop_timeout_s: Seconds = Field(
        default=30.0, description="SIGTERM grace per role before SIGKILL."
    )
    ready_timeout_s: Seconds = Field(
        default=300.0, description="Longest wait for a role to become ready."
    )
    restarts: int = Field(
        default=0, ge=0, description="Restart a role that exits unexpectedly this many times."
    )
    reward_failure_steps: int = Field(
        default=5,
        ge=0,
        description="A reward function that failed on every sample of this many steps in a "
        "row is reported (and ends the run unless on_reward_failure is warn); 0: never.",
    )
    on_reward_failure: Literal["stop", "warn"] = Field(
        default="stop", description="What a reward function failing on every sample does."
    )
    prefork: bool = Field(
        default=True,
        description="Fork the `python -m` roles from one process that has imported torch and "
        "transformers (core.prefork) instead of starting each from scratch; false: exec each.",
    )
    pin_cores: bool = Field(
        default=False,
        description="Pin roles to CPU cores (os.sched_setaffinity): trainer and streams on "
        "the last core, engine and producer on the others, as if on separate devices.",
    )


class _Remembered(dict[str, "RollstreamConfig"]):
    """Views built from a config's values: a cache, so never part of its equality."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Remembered)

    __hash__ = None  # type: ignore[assignment]


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
        "overrides for the roles serving it (rollstream.config.policies); empty: one policy.",
    )

    _views: _Remembered = PrivateAttr(default_factory=_Remembered)
    """``view``'s results: each policy's view is built once per config."""
    _siblings: _Remembered = PrivateAttr(default_factory=_Remembered)
    """Every policy's view as ``load_config`` resolved it from the same sources."""

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> RollstreamConfig:
        """A copy that remembers no views: they were built from this config's values."""
        copy = super().model_copy(update=update, deep=deep)
        copy._views, copy._siblings = _Remembered(), _Remembered()
        return copy

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
        if policy not in self._views:  # load_config resolved it from the sources already
            self._views[policy] = self._siblings.get(policy) or policy_view(self, policy)
        return self._views[policy]

    def peer(self, policy: str) -> RollstreamConfig:
        """``policy``'s view resolved from the same sources as this config (a producer's
        peer policies): built once by ``load_config``, not resolved again."""
        if policy not in self._siblings:
            known = ", ".join(sorted(self._siblings)) or "none resolved with this config"
            raise ConfigurationError(f"no policy {policy!r} to serve as a peer (known: {known})")
        return self._siblings[policy]

    def gateway_dlq_topics(self) -> list[str]:
        """The gateway's dead-letter topic, where a gateway runs."""
        gateway = self.producers.rollout.gateway
        return [gateway.dead_letter_topic] if gateway.enabled else []

    def topic_specs(self) -> list[TopicSpec]:
        """Every topic of this run under the names its sections give (tests and shared
        clusters rename them), with the partitions and configs of ``schemas.topics``."""
        names = [
            (ROLLOUTS_RAW, {self.producers.rollout.topic, self.streams.topics.raw}),
            (ROLLOUTS_SCORED, {self.streams.topics.scored, self.trainer.topics.scored}),
            (ROLLOUTS_STALE, {self.streams.topics.stale}),
            (
                ROLLOUTS_DLQ,
                {self.streams.topics.dlq, self.trainer.topics.dlq, *self.gateway_dlq_topics()},
            ),
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


def load_config(
    path: Path | None = None, *, policy: str | None = None, **overrides: Any
) -> RollstreamConfig:
    """The whole config from its sources (``core.config_sources.read_sources``, each read
    once): explicit ``overrides`` > ``ROLLSTREAM_*`` variables > ``KAFKA_BOOTSTRAP_SERVERS``
    / ``AWS_ENDPOINT_URL[_S3]`` > the TOML file > the ``[profile]``'s settings > defaults,
    validated once. The shared settings (``rollstream.config.shared``) are propagated
    from ``[profile]`` into every role's section, and a source contradicting them refused.

    ``policy`` picks one policy of a multi-policy run: its ``[policies.<name>]`` table is
    laid over the sources and its names are renamed into its namespace
    (``rollstream.config.policies``) before the profile derives the roles' settings, so a policy
    with its own ``profile.model`` gets that model's settings everywhere. Every policy's
    view is built once here, so a bad table fails whichever role starts first, and kept
    on the result (``RollstreamConfig.peer``) for a producer's peers.

    What a role receives is cut from the result by ``role_config``: the same shape,
    ``RoleConfig(shared, section)``, for every role."""
    sources = read_sources(RollstreamConfig, path, overrides)
    explicit = sources.merged()

    def validate(values: dict[str, Any]) -> RollstreamConfig:
        return sources.validate(RollstreamConfig, values)

    policy = policy or explicit.get("policy")  # ROLLSTREAM_POLICY or `--set policy=...`
    if not explicit.get("policies") and not policy:
        return resolved(explicit, sources.layers, validate)  # the one validation
    raw = validate(explicit)
    views = {name: policy_view(raw, name, overrides, sources) for name in raw.policies}
    check_peers(views)
    policy = policy or raw.policy
    if policy:
        config = views[policy] if policy in views else policy_view(raw, policy, overrides)
    else:
        config = resolved(explicit, sources.layers, validate)
    config._siblings.update(views)
    return config


def resolved(
    values: dict[str, Any],
    layers: Sequence[Layer],
    validate: Callable[[dict[str, Any]], RollstreamConfig],
) -> RollstreamConfig:
    """``values`` (explicit settings, from ``layers``) with what their ``[profile]``
    derives laid under them, the shared settings checked against ``layers``, validated."""
    try:
        profile = ProfileConfig.model_validate(values.get("profile") or {})
    except ValidationError:
        validate(values)  # refuses the profile, naming its key and source
        raise
    check_shared(layers, profile)
    return validate(merge_tables(derived_sections(profile), values))


CONFIG_SOURCES = "rollstream.sources"
"""Where the ``rollstream`` group keeps its ``ConfigSources`` (``click.Context.meta``)."""


@dataclasses.dataclass(frozen=True)
class ConfigSources:
    """What a process's configuration is resolved from: the file (``--config``), the
    explicit overrides (``--set``, ``--state-dir``) and the policy served (``--policy``).
    The ``rollstream`` group resolves them once; a command whose own options change the
    profile (``up --model``) resolves them instead of the group, with those options."""

    path: Path | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    policy: str | None = None

    def resolve(self, **more: Any) -> RollstreamConfig:
        """``load_config`` of these sources, ``more`` laid over the overrides."""
        overrides = merge_tables(dict(self.overrides), more)
        return load_config(self.path, policy=self.policy, **overrides)


ProducerRole = Literal[
    "producers", "engine", "producer", "serve", "router", "produce", "gateway", "eval"
]
StreamRole = Literal["streams", "stream"]
TrainerRole = Literal["trainer", "train"]
ROLE_SECTIONS: dict[str, str] = {
    **dict.fromkeys(get_args(ProducerRole), "producers"),
    **dict.fromkeys(get_args(StreamRole), "streams"),
    **dict.fromkeys(get_args(TrainerRole), "trainer"),
}
"""Each role (its name, and the commands that run it) -> the section it runs with."""


@overload
def role_config(
    config: RollstreamConfig,
    role: ProducerRole,
    options: Mapping[str, Any] | None = None,
) -> RoleConfig[ProducersConfig]: ...
@overload
def role_config(
    config: RollstreamConfig,
    role: StreamRole,
    options: Mapping[str, Any] | None = None,
) -> RoleConfig[StreamsConfig]: ...
@overload
def role_config(
    config: RollstreamConfig, role: TrainerRole, options: Mapping[str, Any] | None = None
) -> RoleConfig[TrainerConfig]: ...
@overload
def role_config(
    config: RollstreamConfig, role: str, options: Mapping[str, Any] | None = None
) -> RoleConfig[ProducersConfig] | RoleConfig[StreamsConfig] | RoleConfig[TrainerConfig]: ...
def role_config(
    config: RollstreamConfig, role: str, options: Mapping[str, Any] | None = None
) -> RoleConfig[ProducersConfig] | RoleConfig[StreamsConfig] | RoleConfig[TrainerConfig]:
    """What ``role`` receives from the resolved ``config``: ``RoleConfig(shared,
    section)``, the shared sections alone (a ``SharedConfig``, not the whole file) and the
    role's own section with the command's ``options`` (a nested table in the section's
    layout; ``None`` values are options not given) laid over it. ``rollstream config
    --role`` prints this, so what it shows is what the role gets."""
    if role not in ROLE_SECTIONS:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLE_SECTIONS)}")
    section = getattr(config, ROLE_SECTIONS[role])
    return RoleConfig(shared_config(config), with_options(section, options or {}))


def shared_config(config: SharedConfig) -> SharedConfig:
    """The shared sections of ``config`` as a ``SharedConfig`` (no sources read again:
    the values are already resolved and validated)."""
    names = set(SharedConfig.model_fields)
    values = {name: getattr(config, name) for name in names}
    return SharedConfig.model_construct(config.model_fields_set & names, **values)


def with_options(section: SectionT, options: Mapping[str, Any]) -> SectionT:
    """``section`` with a command's own options laid over it (``produce --groups``, ``train
    --max-steps``): validated again only when one is given."""
    given = _given(options)
    if not given:
        return section
    return type(section).model_validate(merge_tables(section.model_dump(), given))


def _given(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without the ones not given (``None``), nested tables included."""
    given: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, Mapping):
            value = _given(value) or None
        if value is not None:
            given[key] = value
    return given


def role_json(config: RollstreamConfig, role: str) -> dict[str, Any]:
    """What ``rollstream config --role`` prints: ``role_config(config, role)`` as JSON
    (secrets masked), the role's section under its name, and the ``[profile]`` its
    settings were derived from."""
    shared, section = role_config(config, role)
    return {
        **shared.model_dump(mode="json"),
        ROLE_SECTIONS[role]: section.model_dump(mode="json"),
        "profile": config.profile.model_dump(mode="json"),
    }


def policy_view(
    raw: RollstreamConfig,
    policy: str,
    overrides: dict[str, Any] | None = None,
    sources: Sources | None = None,
) -> RollstreamConfig:
    """``policy``'s view of ``raw`` (a config before its profile is applied). Explicit
    ``overrides`` (``--set``) win over the policy's table too: a second stream worker of a
    policy gets its own port on its command line. ``sources``: the layers ``raw`` was
    read from, against which the policy's shared settings are checked (without them,
    only the policy's table is)."""
    explicit = raw.model_dump(exclude_unset=True)
    values = policy_values(explicit, raw.model_dump(), raw.policies, policy)
    given = {k: v for k, v in (overrides or {}).items() if k != "policy"}
    values = merge_tables(values, given)
    below = sources.layers[1:] if sources is not None else ()
    layers = [Layer("--set", given), Layer(f"[policies.{policy}]", raw.policies[policy]), *below]
    try:
        return resolved(values, layers, partial(from_values, RollstreamConfig))
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
