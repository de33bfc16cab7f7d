"""Typed configuration of the trainer (the ``[trainer]`` section of the rollstream TOML).

Light on purpose: pydantic only, no torch, so ``python -m consumers --help`` and a dry run
validate a config without importing anything heavy. Every model rejects unknown keys and
is immutable; each field's description is its help text. Nested tables::

    [trainer]                 publish_every, max_steps, metrics_file, ledger_file, ...
    [trainer.model]           which causal LM to train
    [trainer.batch]           how Kafka records become micro-batches
    [trainer.engine]          DeepSpeed: ZeRO stage, bf16, accumulation, clipping, AdamW
    [trainer.loss]            the loss variant (``consumers.loss_config``, chosen by ``type``)
    [trainer.approx]          records without exact ``logp_old`` (the approximate route)
    [trainer.staleness]       the staleness window enforced at training time
    [trainer.checkpoint]      where and how often checkpoints (with Kafka offsets) are saved
    [trainer.topics]          topic names and the consumer group
    [trainer.retry]           back-off for S3 and Kafka outages
    [trainer.guards]          stability guards: collapse signals and actions (consumers.guards)

One trainer step (a scored batch) = ``engine.grad_accum_steps`` micro-batches, trained in
``[trainer.ppo] epochs x minibatches`` optimiser steps (one by default); one micro-batch = what
``[trainer.batch]`` gathers from Kafka (whole groups, bounded by a group count, a token
budget and a wait limit). The policy version published after step ``n`` is ``n``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from consumers.guard_config import GuardsConfig
from consumers.loss_config import GrpoLossConfig, LossConfig, PpoEwmaLossConfig
from core.config import (
    MetricsHost,
    Port,
    RetryConfig,
    Seconds,
    SharedConfig,
    StrictModel,
    TopicName,
)
from core.models import MODEL_SPEC_HELP, ModelSpecName


class ModelConfig(StrictModel):
    """The causal LM being trained. ``[trainer] model = "<spec>"`` is short for
    ``[trainer.model] spec = "<spec>"``."""

    spec: ModelSpecName = Field(
        default="tiny",
        description=MODEL_SPEC_HELP + " The same spec as [producers.engine] model and "
        "[streams.old_logits] model; loaded in float32 (DeepSpeed casts it for bf16).",
    )
    pad_token_id: int | None = Field(
        default=None,
        description="Token id used to pad batches; empty means the model config's pad (or 0).",
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Sampling temperature of the generators: logits are divided by it before the "
            "log-softmax (as core.logprobs does for logp_old), so logp_new, logp_old "
            "and logp_infer describe the same distribution."
        ),
    )
    max_length: int | None = Field(
        default=None,
        gt=1,
        description=(
            "Longest prompt + response accepted; longer records go to the DLQ. Empty means "
            "the model's max_position_embeddings."
        ),
    )


class BatchConfig(StrictModel):
    """How records from ``rollouts.scored`` become micro-batches (whole groups only)."""

    max_groups: int = Field(
        default=8, ge=1, description="A micro-batch is closed once it holds this many groups."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Token budget of a micro-batch (prompt + response tokens, unpadded): a micro-batch "
            "is closed before a group would exceed it (a single group larger than the budget "
            "is trained alone). Empty: no token budget."
        ),
    )
    max_wait_s: Seconds = Field(
        default=10.0,
        description=(
            "A micro-batch holding at least one group is closed after waiting this long for "
            "more, so a slow or idle partition never stalls training. With no group at all "
            "the trainer keeps waiting (and keeps polling Kafka)."
        ),
    )
    poll_timeout_s: Seconds = Field(
        default=0.2, description="Longest single Kafka poll while waiting for records."
    )
    order: Literal["arrival", "deadline"] = Field(
        default="deadline",
        description=(
            "Which partition's next group is taken first. arrival: the oldest record "
            "(timestamp). deadline: the group nearest to expiry, i.e. with the oldest policy "
            "version (the stream's rs-min-version header; arrival order for records without "
            "it), so long rollouts, which are the ones that go stale, are trained before "
            "they expire. Within a partition the order is always the log's (offsets commit "
            "in order)."
        ),
    )


class PpoConfig(StrictModel):
    """Several optimiser steps per scored batch, as every PPO implementation offers.

    With ``epochs = minibatches = 1`` (one optimiser step per batch) the policy being trained
    equals the generating policy at staleness 0, the ratio is exactly 1 and the clip never
    acts: the update is unclipped REINFORCE. More steps per batch make the clip a real trust
    region at every staleness. One trainer step (one published version) is still one
    scored batch: ``epochs x minibatches`` optimiser steps, each over
    ``engine.grad_accum_steps`` micro-batches.
    """

    epochs: int = Field(
        default=1, ge=1, le=64, description="Passes over each scored batch (PPO epochs)."
    )
    minibatches: int = Field(
        default=1,
        ge=1,
        le=256,
        description=(
            "Optimiser steps per pass: the batch's trajectories are split into this many "
            "minibatches (fewer when the batch has fewer trajectories than minibatches x "
            "grad_accum_steps; the metric ppo/optimizer_steps says how many were taken)."
        ),
    )
    shuffle: bool = Field(
        default=True,
        description=(
            "Shuffle the trajectories before each pass (seeded by engine.seed and the step, "
            "so a replay reproduces it); false keeps arrival order."
        ),
    )

    def optimizer_steps(self) -> int:
        """Optimiser steps per scored batch at most."""
        return self.epochs * self.minibatches


#: ``transformers.get_scheduler`` names that need no arguments besides the step counts.
LrSchedulerName = Literal[
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
]
DECAYING_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial")


class EngineConfig(StrictModel):
    """The DeepSpeed engine and its AdamW optimiser."""

    accelerator: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="auto: cuda when torch sees a GPU, else cpu. Sets DS_ACCELERATOR.",
    )
    dist_backend: str | None = Field(
        default=None, description="torch.distributed backend; empty: nccl on cuda, gloo on cpu."
    )
    dist_timeout_s: Seconds = Field(
        default=86_400.0,
        description="How long a trainer rank waits in a collective: the ranks besides 0 wait "
        "there while rank 0 waits for data, so this bounds how long a run may sit idle.",
    )
    zero_stage: int = Field(
        default=1, ge=0, le=3, description="ZeRO stage (0-2 on CPU; 3 needs GPUs)."
    )
    bf16: bool = Field(
        default=True,
        description="bf16 weights and compute with fp32 master weights in the optimiser.",
    )
    grad_accum_steps: int = Field(
        default=1, ge=1, description="Micro-batches per optimiser step (gradient accumulation)."
    )
    grad_clip: float | None = Field(
        default=1.0, gt=0, description="Clip the global gradient norm at this value; empty: off."
    )
    lr: float = Field(
        default=1e-5, gt=0, description="AdamW learning rate: the peak of lr_scheduler."
    )
    lr_scheduler: LrSchedulerName = Field(
        default="constant",
        description="transformers.get_scheduler name, stepped once per optimiser step: "
        "constant, constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial, "
        "inverse_sqrt. Its position is saved with each checkpoint.",
    )
    warmup_steps: int = Field(
        default=0, ge=0, description="Optimiser steps of linear warmup from 0 to lr."
    )
    decay_steps: int | None = Field(
        default=None,
        ge=1,
        description="Optimiser steps over which linear, cosine, cosine_with_restarts and "
        "polynomial decay to 0 (warmup included); required by those schedules.",
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    seed: int = Field(default=0, description="torch seed set before building the engine.")
    deterministic: bool = Field(
        default=False,
        description="Bit-for-bit repeatable steps on CPU: deterministic torch algorithms and "
        "one compute thread, so the crash tests can compare weights with a run that never "
        "crashed (slower).",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward (less memory, slower)."
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra DeepSpeed config keys merged over the generated ones (e.g. "
            "zero_optimization.offload_optimizer). Use with care."
        ),
    )

    @model_validator(mode="after")
    def _decay_has_a_length(self) -> EngineConfig:
        """A decaying schedule without its length would decay over a default nobody chose."""
        if self.lr_scheduler in DECAYING_SCHEDULES:
            if self.decay_steps is None:
                raise ValueError(
                    f"lr_scheduler = {self.lr_scheduler!r} decays over decay_steps: set "
                    "[trainer.engine] decay_steps (optimiser steps, warmup included)"
                )
            if self.decay_steps <= self.warmup_steps:
                raise ValueError(
                    f"decay_steps ({self.decay_steps}) must exceed warmup_steps "
                    f"({self.warmup_steps})"
                )
        return self


class ApproxConfig(StrictModel):
    """Records whose ``old_logits_status`` is not ``exact`` (no trustworthy ``logp_old``).

    route = ewma: the anchor of those records is ``logp_prox``, the log-probs under an EWMA
    of the trainer's past weights (``consumers.ewma``), computed by a forward pass of a
    proximal copy of the model in the same batch layout. Exact records keep ``logp_old``.
    route = infer: the anchor is ``logp_infer`` (d = 1: the whole ratio is treated as
    staleness). route = current: the anchor is the detached log-probs of the weights being
    trained (s = 1, d = pi_theta / pi_infer): what a pipeline that loses the old logits and
    recomputes them at training time does, kept as a baseline for ablations. route = drop:
    those records are skipped (counted, not trained; their offsets still advance).
    The ``ppo_ewma`` loss always anchors on the EWMA (its own beta and reset settings win).
    """

    route: Literal["ewma", "infer", "current", "drop"] = Field(
        default="ewma", description="How the loss is anchored for records without exact logp_old."
    )
    beta: float = Field(
        default=0.75, ge=0, lt=1, description="EWMA decay for route=ewma with decoupled losses."
    )
    reset_below: float | None = Field(
        default=0.8,
        ge=0,
        le=1,
        description="EWMA automatic reset threshold on train_infer/kept_frac; empty: never.",
    )
    reset_rule: Literal["below", "drop"] = Field(
        default="drop",
        description=(
            "below: reset when kept_frac < reset_below; drop: when kept_frac < reset_below x "
            "its running level (does not reset at every step under a tight MIS band)."
        ),
    )
    exact_for_ppo_ewma: bool = Field(
        default=True,
        description=(
            "With the ppo_ewma loss: anchor records that do have exact logp_old on it (True) "
            "or anchor every record on the EWMA proximal policy (False, the pure baseline)."
        ),
    )


class StalenessConfig(StrictModel):
    """The staleness window, enforced when a group is trained.

    A group waits in ``rollouts.scored`` after the stream checked it, and under a backlog
    the trainer's version moves on meanwhile. So the trainer checks again, against the
    version it is about to train (staleness = that version - the group's oldest segment
    version): a group over the limit is never trained; it goes, whole, to
    ``topics.stale`` with its staleness (``StaleRecord`` with ``stage = "trainer"``). The
    bound ``staleness/max <= max_staleness`` then holds whatever the backlog.
    """

    max_staleness: int | None = Field(
        default=4,
        ge=0,
        description=(
            "Most versions a trained group may lag the version being trained. Filled from "
            "[profile] staleness_window, the run's one declared window. "
            "Empty: no check at training time. With the stream's staged mode set it to the "
            "oldest lag a stage admits (stage_versions x (stages_admitted + 1) - 1), or empty."
        ),
    )
    over_window: Literal["route", "relaxed_clip"] = Field(
        default="route",
        description=(
            "A group over max_staleness: route (to topics.stale, never trained) or "
            "relaxed_clip (trained, its tokens clipped with relaxed_clip_bounds instead of "
            "the loss's own interval, as Mu-GRPO does for stale data), up to "
            "relaxed_max_staleness. Long rollouts are the ones that go stale, so routing "
            "them biases training towards short answers. For records to reach the trainer, "
            "set [streams.staleness] max_staleness to relaxed_max_staleness."
        ),
    )
    relaxed_clip_bounds: tuple[float, float] = Field(
        default=(0.0, 5.0),
        description="[low, high] clip interval of the ratio for over-window groups "
        "(over_window = relaxed_clip); Mu-GRPO's [0, 5].",
    )
    relaxed_max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="With over_window = relaxed_clip: groups beyond this lag are routed "
        "after all. Empty: 2 x max_staleness.",
    )

    @model_validator(mode="after")
    def _relaxed(self) -> StalenessConfig:
        low, high = self.relaxed_clip_bounds
        if not 0.0 <= low <= 1.0 <= high or low == high:
            raise ValueError(
                f"relaxed_clip_bounds must satisfy 0 <= low <= 1 <= high, got {(low, high)}"
            )
        if (
            self.relaxed_max_staleness is not None
            and self.max_staleness is not None
            and self.relaxed_max_staleness < self.max_staleness
        ):
            raise ValueError("relaxed_max_staleness must be at least max_staleness")
        return self

    def route_limit(self) -> int | None:
        """The lag beyond which a group is routed, not trained."""
        if self.max_staleness is None or self.over_window == "route":
            return self.max_staleness
        if self.relaxed_max_staleness is not None:
            return self.relaxed_max_staleness
        return 2 * self.max_staleness


class CheckpointConfig(StrictModel):
    """DeepSpeed checkpoints that carry the Kafka offsets they cover (crash safety)."""

    dir: Path | None = Field(
        default=None,
        description=(
            "Directory of the checkpoints and of the LATEST marker; empty: "
            "<state_dir>/trainer/<run_id>/checkpoints."
        ),
    )
    every: int = Field(
        default=10,
        ge=1,
        description=(
            "Checkpoint every this many trainer steps (and at a clean stop). Offsets are "
            "committed to Kafka only after the checkpoint is durable, so a crash re-trains "
            "at most this many steps' records, never twice into the same weights."
        ),
    )
    keep: int = Field(default=2, ge=1, description="How many complete checkpoints to keep.")
    fsync: bool = Field(
        default=True, description="fsync checkpoint files before marking them LATEST."
    )


class TopicsConfig(StrictModel):
    """Kafka names (tests use unique ones)."""

    scored: TopicName = Field(default="rollouts.scored", description="Scored groups to train on.")
    dlq: TopicName = Field(default="rollouts.dlq", description="Where undecodable records go.")
    stale: TopicName = Field(
        default="rollouts.stale", description="Where groups too stale to train go."
    )
    versions: TopicName = Field(default="policy.versions", description="Version announcements.")
    group_id: TopicName = Field(
        default="rollstream-trainer",
        description=(
            "Consumer group of the trainer. One trainer process per group: offsets come "
            "from its checkpoints (DeepSpeed ranks > 0 receive their data from rank 0)."
        ),
    )
    group_instance_id: str | None = Field(
        default="rollstream-trainer-0",
        description=(
            "Static group membership (group.instance.id): a restarted trainer takes its "
            "partitions back at once instead of waiting for the dead member's session to "
            "expire, and a second live trainer with the same id is fenced. Empty: dynamic."
        ),
    )
    session_timeout_ms: int = Field(
        default=45_000, ge=6_000, description="librdkafka session.timeout.ms."
    )
    max_poll_interval_ms: int = Field(
        default=900_000,
        ge=10_000,
        description="librdkafka max.poll.interval.ms: longest step + checkpoint + publish.",
    )


class PublishConfig(StrictModel):
    """Weight publishing through ``weights.DeltaWriter``."""

    every: int | None = Field(
        default=1,
        ge=1,
        description="Publish version n after every step n divisible by this; 0 or empty: "
        "never (TOML has no empty value: write 0).",
    )
    initial: bool = Field(
        default=True,
        description="Publish version 0 (the initial weights) when the store has no version.",
    )
    announce: bool = Field(default=True, description="Announce versions on topics.versions.")
    dtype: Literal["trainer", "bfloat16"] = Field(
        default="trainer",
        description="What a version holds: trainer = the trainer's weights as they are; "
        "bfloat16 = their bf16 copy, which an fp32 trainer then computes on while keeping "
        "fp32 master weights (docs/configuration.md, 'What a version holds').",
    )
    gc_every: int | None = Field(
        default=10,
        ge=1,
        description="Apply the retention window ([weights] keep_versions) to the home store "
        "after every N published versions; empty: only `rollstream weights gc` deletes.",
    )

    @field_validator("every", mode="before")
    @classmethod
    def _zero_is_never(cls, value: object) -> object:
        return None if value in (0, "0", "") else value


class TrainerConfig(StrictModel):
    """Everything the trainer needs besides the Kafka/S3 connection and the run id."""

    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description='[trainer.model]; a string is a model spec: model = "tiny".',
    )
    batch: BatchConfig = Field(default_factory=BatchConfig, description="[trainer.batch]")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="[trainer.engine]")
    ppo: PpoConfig = Field(default_factory=PpoConfig, description="[trainer.ppo]")
    loss: LossConfig = Field(
        default_factory=GrpoLossConfig,
        description="[trainer.loss]: grpo | decoupled | mu_grpo | ppo_ewma (by type).",
    )
    approx: ApproxConfig = Field(default_factory=ApproxConfig, description="[trainer.approx]")
    staleness: StalenessConfig = Field(
        default_factory=StalenessConfig, description="[trainer.staleness]"
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="[trainer.checkpoint]"
    )
    topics: TopicsConfig = Field(default_factory=TopicsConfig, description="[trainer.topics]")
    retry: RetryConfig = Field(default_factory=RetryConfig, description="[trainer.retry]")
    publish: PublishConfig = Field(default_factory=PublishConfig, description="[trainer.publish]")
    guards: GuardsConfig = Field(
        default_factory=GuardsConfig,
        description="[trainer.guards]: entropy, mismatch, flat_rewards, non_finite, rollback.",
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="Stop cleanly after this many trainer steps (scored batches) in total.",
    )
    metrics_file: Path | None = Field(
        default=None, description="Append one JSON object of metrics per step (JSONL)."
    )
    ledger_file: Path | None = Field(
        default=None,
        description=(
            "Append the trajectory ids of every step once a checkpoint covering it is "
            "durable (JSONL, one line per step); used to audit exactly-once training. "
            "Empty: ledger.jsonl in the checkpoint directory (always kept)."
        ),
    )
    prometheus_port: Port | None = Field(
        default=None, description="Serve Prometheus metrics on this port."
    )
    prometheus_host: MetricsHost = "127.0.0.1"
    progress: bool = Field(default=True, description="Show a rich progress line on stderr.")

    @field_validator("model", mode="before")
    @classmethod
    def _model_spec_string(cls, value: Any) -> Any:
        return {"spec": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if isinstance(self.loss, PpoEwmaLossConfig) and self.approx.route != "ewma":
            raise ValueError("the ppo_ewma loss needs approx.route = 'ewma'")
        if self.engine.zero_stage == 3 and self.engine.accelerator == "cpu":
            raise ValueError("ZeRO stage 3 needs GPUs (engine.zero_stage <= 2 on cpu)")
        if self.trains_on_shipped_copy() and self.engine.zero_stage == 3:
            raise ValueError(
                "publish.dtype = 'bfloat16' with fp32 training (engine.bf16 = false) needs "
                "engine.zero_stage <= 2: under ZeRO-3 no rank holds the weights to round"
            )
        window, every = self.staleness.max_staleness, self.publish.every
        if window is not None and every is not None and every > window + 1:
            raise ValueError(
                f"publish.every = {every} is more than staleness.max_staleness + 1 = "
                f"{window + 1}: producers get credit per announced version for "
                "max_staleness + 1 steps of groups, so generation would stall between "
                "versions (and data would go stale); publish more often or widen the window"
            )
        return self

    def groups_per_step(self) -> int:
        """Groups one trainer step takes at most (what the trainer announces)."""
        return self.batch.max_groups * self.engine.grad_accum_steps

    def ewma_settings(self) -> tuple[float, float | None, str]:
        """(beta, reset_below, reset_rule) of the proximal EWMA: the ppo_ewma loss's own,
        else approx's."""
        if isinstance(self.loss, PpoEwmaLossConfig):
            return self.loss.beta, self.loss.reset_below, self.loss.reset_rule
        return self.approx.beta, self.approx.reset_below, self.approx.reset_rule

    def trains_on_shipped_copy(self) -> bool:
        """Whether versions are a bf16 copy of fp32 weights, so the forward passes run on
        that copy (``consumers.shipped_weights``)."""
        return self.publish.dtype == "bfloat16" and not self.engine.bf16

    def needs_old_logp(self) -> bool:
        """Whether the loss anchors on logp_old (so non-exact records need the route)."""
        loss = self.loss
        if loss.type in ("decoupled", "ppo_ewma"):
            return True
        return loss.type == "mu_grpo" and loss.ratio_source == "staleness"


def trainer_home(state_dir: Path, run_id: str, policy: str = "") -> Path:
    """``<state_dir>/trainer/<run_id>[/<policy>]``: a run's trainer files by default
    (checkpoints, ledger; metrics where ``rollstream report`` looks; a fork's own)."""
    home = state_dir / "trainer" / run_id
    return home / policy if policy else home


def checkpoint_dir(shared: SharedConfig, trainer: TrainerConfig) -> Path:
    """Where the trainer's checkpoints are: ``trainer.checkpoint.dir``, by default under the
    state dir, per run and policy, so two runs (or two policies) never share checkpoints."""
    if trainer.checkpoint.dir is not None:
        return trainer.checkpoint.dir
    return trainer_home(shared.state_dir, shared.run_id, shared.policy) / "checkpoints"


def ledger_path(shared: SharedConfig, trainer: TrainerConfig) -> Path:
    """The trainer's ledger: ``trainer.ledger_file``, by default ``ledger.jsonl`` beside
    the checkpoints it accounts for (a trainer resumed from them continues it, a fresh
    checkpoint directory starts a fresh one). Pure: ``rollstream audit`` finds it from the
    same config, wherever the trainer was started."""
    if trainer.ledger_file is not None:
        return trainer.ledger_file
    return checkpoint_dir(shared, trainer) / "ledger.jsonl"
