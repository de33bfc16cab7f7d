"""Configuration of the producer role: the CPU engine and the rollout worker.

Light on purpose (pydantic only, no torch), like ``rollstream.config.settings``: entry points parse
and validate it before importing anything heavy. Unknown keys are errors, instances are
immutable. ``ProducersConfig`` is the ``producers`` section of ``RollstreamConfig``: the
one config file every role reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from core.config import MetricsHost, Port, SafeName, Seconds, StrictModel, TopicName
from producers.engine.config import EngineConfig, SamplingConfig

VersionPolicy = Literal["finish", "interrupt", "abort"]


class CurriculumConfig(StrictModel):
    """Skip prompts the stream's statistics (``prompts.stats``) call solved or hopeless."""

    enabled: bool = Field(
        default=False,
        description="Read prompts.stats and resample prompts outside the pass-rate band.",
    )
    topic: TopicName = Field(
        default="prompts.stats", description="The stream's per-prompt statistics topic."
    )
    min_pass_rate: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Skip a prompt whose pass rate is at or below this (hopeless) once it has "
        "min_samples; 0 skips prompts never passed. Empty (default): never skip as hopeless "
        "(early in training every prompt has a pass rate of 0).",
    )
    max_pass_rate: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Skip a prompt whose pass rate is at or above this (solved) once it has "
        "min_samples.",
    )
    min_samples: int = Field(
        default=8, ge=1, description="Samples a prompt needs before it can be skipped."
    )
    max_skips: int = Field(
        default=32,
        ge=1,
        description="Prompts resampled for one group at most; then the last one is used, so "
        "generation never stalls when every prompt is outside the band.",
    )

    @model_validator(mode="after")
    def _band(self) -> CurriculumConfig:
        if self.min_pass_rate is not None and self.min_pass_rate >= self.max_pass_rate:
            raise ValueError(
                f"min_pass_rate {self.min_pass_rate} must be below max_pass_rate "
                f"{self.max_pass_rate}"
            )
        return self


class EpisodeConfig(StrictModel):
    """Overrides of a multi-turn environment's own limits (``EpisodeLimits``); empty
    keeps the environment's value."""

    max_turns: int | None = Field(default=None, ge=1, description="Policy turns per episode.")
    max_total_tokens: int | None = Field(
        default=None, ge=1, description="Response tokens per episode, policy and environment."
    )
    episode_timeout_s: Seconds | None = Field(
        default=None, description="Wall time of an episode, checked between turns."
    )
    tool_timeout_s: Seconds | None = Field(
        default=None, description="Time one environment step (a tool call) may take."
    )
    max_observation_tokens: int | None = Field(
        default=None, ge=0, description="Tokens one observation may add to the history."
    )

    def overrides(self) -> dict[str, float | int]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


#: Where the gateway's key is set, as its messages name it.
GATEWAY_KEY_SETTING = "[producers.rollout.gateway] api_key"


class GatewayConfig(StrictModel):
    """The OpenAI-compatible gateway (``rollstream gateway``): agents make the episodes
    (``producers.gateway``) instead of a task's environment."""

    enabled: bool = Field(
        default=False,
        description="Groups are played by agents over HTTP (rollstream up and produce "
        "then run the gateway); rollstream gateway sets it.",
    )
    host: str = Field(
        default="127.0.0.1", description="Address it binds; anything but loopback needs api_key."
    )
    port: Port = Field(default=8100, description="0 picks a free port.")
    api_key: SecretStr | None = Field(
        default=None,
        description="Every endpoint but /health needs 'Authorization: Bearer <key>' (the "
        "openai client's api_key). Required to bind a non-loopback host.",
    )
    served_model_names: list[str] = Field(
        default_factory=list,
        description="Names a call's 'model' may give besides the run's model (the engine's "
        "spec, or expected_model); GET /v1/models lists them all. Any other name is "
        "answered 404 model_not_found.",
    )
    history_mismatch: Literal["split", "refuse"] = Field(
        default="split",
        description="A call whose history does not extend the episode's tokens: 'split' "
        "starts another record of the episode at it, 'refuse' answers 409.",
    )
    max_call_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Largest max_tokens one call may ask for (also the default); None: "
        "the task's max_new_tokens.",
    )
    tool_call_parser: Literal["none", "auto", "hermes", "qwen", "llama3", "mistral"] = Field(
        default="none",
        description="How an answer to a call with tools becomes message.tool_calls: "
        "'hermes' (or 'qwen': <tool_call>{json}</tool_call> blocks; Hermes, Qwen2.5/3, "
        'SmolLM3), \'llama3\' ({"name": ..., "parameters": {...}}, Llama 3.1/3.2), '
        "'mistral' ([TOOL_CALLS] [{...}]), 'auto' (the family whose markers the model's "
        "chat template holds; the gateway does not start when the template takes tools in "
        "no known format); 'none': the text is the content.",
    )
    claim_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="How long opening an episode waits for a group to start before it is "
        "answered 429 (admission: credit, staleness window).",
    )
    idle_timeout_s: Seconds = Field(
        default=120.0,
        description="An episode with no call for this long, or a slot nobody opened, "
        "ends as abandoned (never trained).",
    )
    stop_min_episodes: int = Field(
        default=2,
        ge=1,
        description="When the producer stops, a group with at least this many closed "
        "episodes is published as it is (its open ones abandoned); one with fewer goes to "
        "dead_letter_topic (reason gateway_stopped_incomplete_group). A group of one has no "
        "spread to learn from.",
    )
    dead_letter_topic: TopicName = Field(
        default="rollouts.dlq",
        description="Where closed episodes that cannot be published go: the stream's "
        "[streams.topics] dlq, where rollstream audit reads them.",
    )


class RolloutConfig(StrictModel):
    """What the rollout worker (``rollstream produce``) generates and where it publishes."""

    task: str = Field(
        default="copy-first-digit-twice",
        description="A registered task name (see producers.tasks) or 'module:factory'.",
    )
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the task factory."
    )
    peers: list[str] = Field(
        default_factory=list,
        description="Multi-policy runs: the other policies this producer's episodes call "
        "(each gets its own engine here, following that policy's versions); their turns "
        "are published as records of their own policy.",
    )
    group_size: int = Field(default=8, ge=1, description="G: samples per prompt (one group).")
    groups: int | None = Field(
        default=None, ge=0, description="Groups to deliver, then stop; None runs until signalled."
    )
    max_inflight_groups: int = Field(
        default=4, ge=1, description="Groups generated concurrently (the engine batches them)."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    seed: int | None = Field(default=None, description="Prompt sampling seed; None: random.")
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig, description="[producers.rollout.curriculum]"
    )
    episode: EpisodeConfig = Field(
        default_factory=EpisodeConfig,
        description="[producers.rollout.episode]: limits of multi-turn episodes.",
    )
    staleness_window: int = Field(
        default=4,
        ge=0,
        description="Start no new group once the groups started ahead of the trainer's "
        "trained version reach this many trainer steps + 1 (admission credit), or while the "
        "engine lags the announced version by more. The trainer's announced window wins "
        "when smaller. Filled from [profile] staleness_window, the run's one declared window.",
    )
    ignore_trainer_pause: bool = Field(
        default=False,
        description="Start groups even while the trainer's latest version announcement says "
        "paused (a [trainer.guards] pause): how a person resumes a paused run by hand.",
    )
    groups_per_version: int | None = Field(
        default=None,
        ge=1,
        description="Groups one trainer step takes, for the admission credit (the worker "
        "starts at most (1 + staleness_window) steps of groups ahead of the trainer's trained "
        "version; with staleness_window = 0 generation waits for every update: the "
        "synchronous baseline). None: the trainer's announced groups per step (no credit "
        "limit if it announces none). Set it to share one trainer among several producers.",
    )
    version_policy: VersionPolicy = Field(
        default="interrupt",
        description="On a new version mid-generation: 'finish' on the old weights, "
        "'interrupt' and continue on the new ones (two segments), or 'abort' and regenerate.",
    )
    stop_policy: Literal["abort", "finish"] = Field(
        default="abort",
        description="On SIGTERM/Ctrl-C: 'abort' the groups in flight (never published, but "
        "for a gateway's closed episodes: gateway.stop_min_episodes) or 'finish' them first "
        "(up to stop_finish_timeout_s, then abort the rest). The ledger's last line says "
        "which groups went which way.",
    )
    stop_finish_timeout_s: Seconds = Field(
        default=60.0, description="'finish': longest wait for groups in flight."
    )
    follow_weights: bool = Field(
        default=True,
        description="Follow the run's published versions (WeightFollower on the [s3] store "
        "and [weights] settings): no group starts before the first version is loaded. "
        "False: generate with the engine's own weights, labelled initial_version.",
    )
    initial_version: int = Field(
        default=0, ge=0, description="Version label of the engine's own weights (no following)."
    )
    engine_url: str | None = Field(
        default=None,
        description="URL of an engine speaking SGLang's native API; None runs the engine "
        "in-process from the [engine] section.",
    )
    engine_router: bool = Field(
        default=False,
        description="engine_url is SGLang's router (sglang-router) in front of several "
        "engines: generate through it, load versions on every engine it lists.",
    )
    expected_model: str | None = Field(
        default=None,
        description="model_path the engine must report (get_model_info); None: the [engine] model.",
    )
    connect_timeout_s: Seconds = Field(default=5.0, description="Seconds to connect to the engine.")
    request_timeout_s: Seconds = Field(
        default=600.0, description="Seconds one engine call may take."
    )
    retries: int = Field(
        default=5, ge=1, description="Attempts per engine call on transient errors."
    )
    retry_max_wait_s: Seconds = Field(
        default=10.0, description="Longest backoff between retries of an engine call."
    )
    topic: TopicName = Field(default="rollouts.raw", description="The raw topic records go to.")
    producer_id: SafeName | None = Field(
        default=None,
        description="Stable id of this worker (ledger and records); None: the host name.",
    )
    delivery_timeout_ms: int = Field(
        default=86_400_000,
        ge=1000,
        description="How long librdkafka retries a message while the broker is away.",
    )
    max_undelivered_groups: int = Field(
        default=64, ge=1, description="Start no new group while this many await delivery."
    )
    producer_overrides: dict[str, str] = Field(
        default_factory=dict, description="Extra librdkafka producer properties."
    )
    ledger_fsync: bool = Field(
        default=True,
        description="fsync each group's 'pending' ledger line before producing it (survives "
        "a power cut); else flush to the OS only (survives kill -9).",
    )
    mark_interval_s: Seconds = Field(
        default=30.0, description="How often the ledger records partition end offsets."
    )
    metrics_port: Port | None = Field(
        default=None, description="Serve Prometheus metrics on this port."
    )
    metrics_host: MetricsHost = "127.0.0.1"
    progress: bool = Field(default=True, description="Show a progress line on a terminal.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.max_inflight_groups > self.max_undelivered_groups:
            raise ValueError("max_inflight_groups must not exceed max_undelivered_groups")
        return self


class EvalConfig(StrictModel):
    """``rollstream eval``: the task's eval split, generated and scored every N versions."""

    every_versions: int = Field(
        default=0,
        ge=0,
        description="Evaluate each version that is a multiple of this (0: no evaluation, "
        "and every stored version for `rollstream eval --stored`; `rollstream up` starts "
        "the eval role when it is set).",
    )
    samples_per_prompt: int = Field(default=1, ge=1, le=64, description="Completions per prompt.")
    temperature: float = Field(
        default=0.0, ge=0.0, le=10.0, description="0: greedy; else sampled at this temperature."
    )
    max_prompts: int | None = Field(
        default=None, ge=1, description="Evaluate the first this many eval prompts (none: all)."
    )
    engine_url: str | None = Field(
        default=None,
        description="An engine of its own speaking SGLang's API (none: one in this process). "
        "Not the producers' engine: the eval loads each version it measures.",
    )
    metrics_file: Path | None = Field(
        default=None,
        description="JSONL, one row per evaluated version (none: "
        "<state_dir>/eval/<run>[/<policy>]/metrics.jsonl, where `rollstream report` looks).",
    )

    @staticmethod
    def default_metrics_file(state_dir: Path, run: str, policy: str = "") -> Path:
        """Where a run's eval rows go without ``metrics_file``, and where ``rollstream
        report`` looks for them."""
        home = Path(state_dir) / "eval" / run
        return (home / policy if policy else home) / "metrics.jsonl"


class ProducersConfig(StrictModel):
    """The ``producers`` section: engine, rollout worker and evaluation."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
