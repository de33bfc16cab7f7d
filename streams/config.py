"""Configuration of the stream processors: the ``[streams]`` section of the TOML file.

Light on purpose (pydantic only, no torch, no Faust): ``rollstream stream --help`` and
config validation stay instant. Every field is described; unknown keys are errors.

The whole file is read by ``rollstream.config.settings.load_config``, which holds
``StreamsConfig`` as its ``streams`` section and hands it to the worker.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from core.config import MetricsHost, Port, RestartConfig, Seconds, StrictModel, TopicName
from core.devices import DEVICE_NAMES, check_device_name
from core.models import MODEL_SPEC_HELP, ModelSpecName, parse_model_spec
from schemas.codec import MAX_RECORD_BYTES
from schemas.validation import MAX_GROUP_SIZE, MAX_GROUP_SIZE_LIMIT


class StreamTopics(StrictModel):
    """Topic names (tests use unique ones); defaults are ``schemas.topics``."""

    raw: TopicName = Field(
        default="rollouts.raw", description="Input: trajectories keyed by group id."
    )
    scored: TopicName = Field(
        default="rollouts.scored", description="Output: one ScoredGroup per group."
    )
    stale: TopicName = Field(
        default="rollouts.stale", description="Records outside the staleness window."
    )
    dlq: TopicName = Field(
        default="rollouts.dlq", description="Records that failed validation, with why."
    )
    filtered: TopicName = Field(
        default="rollouts.filtered",
        description="Samples a data operator filtered out, each with the rs-filtered header.",
    )
    prompt_stats: TopicName = Field(
        default="prompts.stats",
        description="Compacted per-prompt statistics (PromptStats) for the producers' curriculum.",
    )
    versions: TopicName = Field(
        default="policy.versions", description="Compacted VersionAnnouncement topic (trainer)."
    )
    ticks: TopicName | None = Field(
        default=None,
        description="Internal timer topic co-partitioned with raw (default <app_id>-ticks).",
    )


class StalenessConfig(StrictModel):
    """Which records are fresh enough to train on (``window``, or Mu-GRPO's ``staged``).

    ``window``: staleness = newest announced version - oldest segment version (floored at
    0); a record is stale when it exceeds ``max_staleness``. ``staged`` (Mu-GRPO):
    versions form stages of ``stage_versions``; a record is admitted while its oldest
    version's stage is at most ``stages_admitted`` stages behind the trainer's, however
    many versions that is, so a stage's data stays usable for all the optimisation steps
    of the stage. Staleness is always measured against one clock, the newest version
    announced on ``policy.versions``, and judged again when a group is emitted.
    """

    mode: Literal["window", "staged"] = Field(
        default="window", description="window: a fixed version window; staged: Mu-GRPO stages."
    )
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="window mode: most versions a record may lag the trainer. Filled from "
        "[profile] staleness_window, the run's one declared window.",
    )
    stage_versions: int = Field(
        default=8, ge=1, description="staged mode: trainer versions per generate/optimise stage."
    )
    stages_admitted: int = Field(
        default=0, ge=0, description="staged mode: how many earlier stages are still admitted."
    )
    future_allowance: int = Field(
        default=1,
        ge=0,
        description="How many versions a record may be ahead of the newest announced "
        "version (its announcement still on its way); further ahead, unless the weight "
        "store holds the version's genuine manifest: dead-lettered as future_version. "
        "Such records count as staleness 0.",
    )


class OldLogitsConfig(StrictModel):
    """Exact old log-probs: the model code, numerics and snapshot store."""

    mode: Literal["exact", "off"] = Field(
        default="exact",
        description="exact: recompute logp_old per segment version; off: mark records 'off'.",
    )
    model: ModelSpecName = Field(
        default="tiny",
        description=MODEL_SPEC_HELP + " The architecture the versions' weights run "
        "through: the same spec as [producers.engine] model and [trainer.model] spec.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Dtype of the forward pass (must match the trainer's)."
    )
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature; logits are divided by it."
    )
    source: Literal["s3", "seeded"] = Field(
        default="s3",
        description="Where versions come from: s3 (WeightFollower on the run's store) or "
        "seeded (version v = the tiny model of `model` initialised with its seed + "
        "seed_base + v; tests and benchmarks only).",
    )
    seed_base: int = Field(default=0, description="seeded source: seed of version 0.")
    max_batch_sequences: int = Field(
        default=32, ge=1, description="Most sequences in one forward pass."
    )
    max_batch_tokens: int = Field(
        default=16_384, ge=1, description="Most padded tokens (rows x width) in one pass."
    )
    device: str = Field(
        default="auto",
        description="Where the old-logit pass runs and the snapshot store holds its "
        f"versions: {DEVICE_NAMES} (auto: cuda when torch sees a GPU, else cpu).",
    )
    snapshot_memory_mb: float = Field(
        default=2048.0,
        gt=0,
        description="Budget of the snapshot store on `device` (LRU beyond; what leaves it "
        "goes where snapshot_overflow says). A version costs parameters x dtype bytes.",
    )
    snapshot_overflow: Literal["rebuild", "host"] = Field(
        default="rebuild",
        description="A version evicted from the device budget: rebuild (dropped, rebuilt "
        "from the source on its next use) or host (kept in host memory within "
        "snapshot_host_memory_mb, copied back to the device on use). Only when device is "
        "not cpu: on cpu there is one tier.",
    )
    snapshot_host_memory_mb: float = Field(
        default=4096.0,
        gt=0,
        description="snapshot_overflow = host: host-memory budget of the versions evicted "
        "from the device (LRU beyond: dropped, rebuilt on use). Unused when device is cpu.",
    )
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads.")
    rebuild_timeout_s: Seconds = Field(
        default=60.0, description="Give up rebuilding a version from S3 after this long."
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        return check_device_name(value)

    @model_validator(mode="after")
    def _seeded_needs_tiny(self) -> OldLogitsConfig:
        tiny = parse_model_spec(self.model, check_path=False).is_tiny
        if self.mode == "exact" and self.source == "seeded" and not tiny:
            raise ValueError(f"source = 'seeded' builds tiny models; model is {self.model!r}")
        return self


class GroupsConfig(StrictModel):
    """Assembling GRPO groups and normalising their advantages."""

    timeout_s: Seconds = Field(
        default=120.0, description="Emit or drop a group this long after its first sample."
    )
    partial_policy: Literal["emit", "drop"] = Field(
        default="emit",
        description="On timeout: emit the samples present (flagged partial) or dead-letter them.",
    )
    min_partial_samples: int = Field(
        default=2, ge=1, description="A timed-out group with fewer samples is dead-lettered."
    )
    emitted_retention_s: float = Field(
        default=3600.0,
        ge=0,
        description="How long an emitted group's id is remembered (late samples are refused).",
    )
    tick_interval_s: Seconds = Field(
        default=1.0, description="How often the worker checks for timed-out groups."
    )
    normalize_std: bool = Field(default=True, description="A = (r - mean)/(std + eps) if true.")
    eps: float = Field(default=1e-6, ge=0, description="Added to the std before dividing.")


class ValidationConfig(StrictModel):
    """Limits applied to every incoming record (``schemas.validation.ValidationLimits``)."""

    vocab_size: int | None = Field(default=None, ge=1, description="Token ids must be below this.")
    max_prompt_tokens: int = Field(default=32_768, ge=1, description="Longest prompt accepted.")
    max_response_tokens: int = Field(default=32_768, ge=1, description="Longest response.")
    max_record_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1, le=MAX_RECORD_BYTES, description="Largest record."
    )
    max_group_size: int = Field(
        default=MAX_GROUP_SIZE,
        ge=1,
        description="Largest group_size a record may claim; larger ones are dead-lettered "
        "(bad_field). A group's state is kept until it closes and rewritten per sample, so "
        f"this bounds its memory and work; at most {MAX_GROUP_SIZE_LIMIT}. The producers' "
        "group_size must not exceed it.",
    )

    @field_validator("max_group_size")
    @classmethod
    def _group_size_bound_is_sane(cls, value: int) -> int:
        """A bound above the limit bounds nothing: refuse it with why."""
        if value > MAX_GROUP_SIZE_LIMIT:
            raise ValueError(
                f"max_group_size {value} is above {MAX_GROUP_SIZE_LIMIT}: the stream rewrites "
                "a group's state per sample and emits the whole group as one Kafka record, "
                "so a larger group cannot be assembled or emitted"
            )
        return value


class PromptStatsConfig(StrictModel):
    """Per-prompt statistics published to ``topics.prompt_stats`` as groups close."""

    enabled: bool = Field(
        default=True,
        description="Publish what each prompt's groups scored (cheap: one small record a group).",
    )
    pass_threshold: float = Field(
        default=1.0,
        description="A sample passes when its reward is at least this (1.0: an exact answer "
        "under the built-in tasks' partial credit).",
    )


class OperatorSpec(StrictModel):
    """One data operator of the chain: a built-in name or a ``package.module:Class`` path."""

    name: str = Field(description="Built-in operator name or dotted path of a user operator.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments the operator is built with."
    )


class StreamsConfig(StrictModel):
    """The stream processors: one Faust app, any number of workers."""

    app_id: TopicName = Field(
        default="rollstream-streams",
        description="Faust app id: consumer group, transactional ids, table changelog prefix.",
    )
    topics: StreamTopics = Field(default_factory=StreamTopics)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    old_logits: OldLogitsConfig = Field(default_factory=OldLogitsConfig)
    groups: GroupsConfig = Field(default_factory=GroupsConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    prompt_stats: PromptStatsConfig = Field(
        default_factory=PromptStatsConfig, description="[streams.prompt_stats]"
    )
    operators: list[OperatorSpec] = Field(
        default_factory=list,
        description="Data operators applied in order to each complete group before it is "
        "scored (empty: none). Each is built at load, so a bad name or option is refused.",
    )

    @field_validator("operators")
    @classmethod
    def _operators_build(cls, specs: list[OperatorSpec]) -> list[OperatorSpec]:
        from streams.operators import build_chain

        build_chain([s.model_dump() for s in specs])
        return specs

    processing_guarantee: Literal["exactly_once", "at_least_once"] = Field(
        default="exactly_once",
        description="exactly_once: outputs, table and offsets in one Kafka transaction.",
    )
    commit_interval_s: Seconds = Field(
        default=1.0, description="How often offsets (and transactions) are committed."
    )
    first_start: Literal["earliest", "committed"] = Field(
        default="earliest",
        description=(
            "Where a raw partition this app never applied anything from starts. earliest: "
            "the log start (everything in the topic). committed: the offset recorded for it "
            "in the compacted control topic '<app_id>-start' when there is one (else the log "
            "start); `rollstream up` records the topic's end there (and commits it for the "
            "app's own group) before a new run's first worker starts, so earlier runs are "
            "not re-read. A topic, not a marker consumer group: a group nobody consumes "
            "with would show as lagging for ever in Kafka's consumer-group tooling."
        ),
    )
    session_timeout_s: Seconds = Field(
        default=60.0,
        description="Consumer group session timeout: how long a dead worker keeps its partitions.",
    )
    metrics_port: Port | None = Field(
        default=None, description="Serve Prometheus metrics on this port (none: off)."
    )
    metrics_host: MetricsHost = "127.0.0.1"
    restart: RestartConfig = Field(
        default_factory=RestartConfig,
        description="`rollstream stream` starts a crashed worker again (core.process).",
    )

    @model_validator(mode="before")
    @classmethod
    def _replication_moved(cls, data: Any) -> Any:
        """One setting replicates every topic now: say where it went."""
        if isinstance(data, dict) and "replication_factor" in data:
            raise ValueError("streams.replication_factor is now [kafka] replication_factor")
        return data

    @model_validator(mode="after")
    def _ticks_differ(self) -> StreamsConfig:
        t = self.topics
        names = [t.raw, t.scored, t.stale, t.dlq, t.filtered, t.prompt_stats]
        if len(set(names)) != len(names):
            raise ValueError(f"the stream's output topics must differ: {names}")
        return self

    @property
    def start_topic(self) -> str:
        """Compacted control topic holding where a new app starts (``first_start``)."""
        return f"{self.app_id}-start"

    @property
    def ticks_topic(self) -> str:
        return self.topics.ticks or f"{self.app_id}-ticks"
