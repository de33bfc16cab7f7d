"""Run replayed records again through a stream step or one trainer step, offline.

Why: to reproduce a decision (why did this record go to the DLQ? would it be stale at
version N?) or a loss spike (which terms blew up on these groups?) on a laptop, from the
records themselves, without touching any role's state. Nothing is written to Kafka.

**Stream** (``rerun_stream``): the records go, in replay order, through
``streams.processor.Processor`` — the stream's own decision logic — with an empty
in-memory table, the ``[streams]`` config, and the trainer version given (or the newest
one announced for the run on the versions topic). Each record's Kafka timestamp is the
processing time, so group timeouts behave as they did. Groups that close are scored with
old logits from ``streams.oldlogits.OldLogitEngine`` built as the worker builds it (the
run's weight store, or seeded versions; ``mode = "off"`` marks them off). ``flush``
closes the groups still open at the end as a timeout would.

**Train** (``rerun_train``): the scored groups are packed as the trainer packs them
(``consumers.batching.pack``), ``logp_new`` is computed by the function the trainer uses
(``response_logprobs``), each record is anchored by ``consumers.step.anchored_inputs``
(the trainer's own route) and the configured loss (``consumers.losses.compute_loss``)
gives the terms; micro-batches are combined as the trainer combines them. No DeepSpeed,
no backward, no optimiser. The weights are those of ``[trainer.model]`` at initialisation,
or a version rebuilt from the run's weight store. Two differences from a live step,
by necessity: an EWMA proximal model is taken fresh (θ_prox = the loaded weights, as the
trainer's first use of it), and the KL reference is the initial model of ``[trainer.model]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from core.config import S3Config, WeightsConfig
from core.models import cast_parameters, load_model
from rollstream.config.settings import RollstreamConfig
from rollstream.debug.records import ReplayRecord
from schemas.group import decode_group
from schemas.trajectory import NO_VERSION, OldLogitsStatus, Trajectory
from weights.announce import AnnouncementListener

if TYPE_CHECKING:
    import torch

    from consumers.config import TrainerConfig
    from rollstream.debug.render import Renderer
    from streams.groups import GroupState
    from streams.oldlogits import OldLogitEngine
    from streams.processor import Message, Send, Step
    from streams.staleness import VersionTracker


# --- stream -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StreamRerunOptions:
    run_id: str
    trainer_version: int | None = None  # None: newest announced for the run
    flush: bool = False


@dataclasses.dataclass
class StreamRerunResult:
    """Every message the stream would have produced, per input record."""

    outputs: list[tuple[ReplayRecord | None, list[Send]]]
    open_groups: list[str]
    trainer_version: int


def latest_announced(client_config: Mapping[str, str], topic: str, run_id: str) -> int:
    """Newest version announced for ``run_id`` on ``topic`` (``NO_VERSION`` if none, or
    if the topic cannot be read: the stream then admits everything, as it does itself)."""
    import click

    listener = AnnouncementListener(client_config, run_id, topic)
    try:
        newest = listener.latest(timeout_s=10.0)
    except TimeoutError as err:
        click.echo(f"no trainer version from {topic}: {err}", err=True)
        return NO_VERSION
    finally:
        listener.close()
    return NO_VERSION if newest is None else newest.version


def resolved_s3(config: RollstreamConfig) -> S3Config:
    """The S3 store, with the embedded one's address and credentials filled in."""
    if not config.s3.starts_embedded:
        return config.s3
    from infra.services import Services

    return Services(config).running(kafka=False).s3


def resolved_weights(config: RollstreamConfig) -> WeightsConfig:
    """``[weights]`` with the state dir's key pair filled in when the config names none,
    so a rerun verifies versions as the run's followers do."""
    from infra.services import Services

    return Services(config).resolved().weights


def old_logit_engine(config: RollstreamConfig, run_id: str) -> OldLogitEngine:
    """The engine the stream worker builds (``streams.faust.app``), for this config."""
    from streams.oldlogits import OldLogitEngine, old_logit_engine_for
    from streams.snapshots import FollowerSource, SeededSource

    old = config.streams.old_logits
    if old.mode == "off":
        return OldLogitEngine(old, None)
    if old.source == "seeded":
        source: Any = SeededSource(old.model, old.seed_base)
    else:
        from weights.follower import WeightFollower
        from weights.store import WeightStore

        store = WeightStore.from_config(resolved_s3(config), run_id, config.policy)
        source = FollowerSource(
            store,
            make_follower=lambda s: WeightFollower.from_config(s, resolved_weights(config)),
            timeout_s=old.rebuild_timeout_s,
        )
    return old_logit_engine_for(old, source, cache_dir=config.cache_dir, lora=config.lora)


class AttachesOldLogits(Protocol):
    def attach(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]: ...


class StreamReplay:
    """The stream's logic over replayed messages, with an in-memory table: the worker's
    ``Processor`` decides, and the groups it emits get old logits from the engine the
    worker builds (``old_logit_engine``, made at the first group to score). ``step`` is
    one message (a raw record or a tick), applied to the table as the worker applies it."""

    def __init__(
        self,
        config: RollstreamConfig,
        run_id: str,
        tracker: VersionTracker,
        engine: AttachesOldLogits | None = None,
    ) -> None:
        """``engine``: where old logits come from (default: the worker's engine)."""
        from streams.processor import Processor

        self.config = config
        self.run_id = run_id
        self.table: dict[bytes, bytes] = {}
        self.processor = Processor(
            config.streams, run_id, tracker, self.table, served_policy=config.policy
        )
        self.engine = engine
        self._ticks: dict[int, int] = {}

    def step(self, msg: Message, now_ms: int) -> Step:
        step = self.processor.handle(msg, now_ms)
        attached: dict[str, list[Trajectory]] = {}
        for closing in step.closings:
            if closing.emit:
                if self.engine is None:
                    self.engine = old_logit_engine(self.config, self.run_id)
                attached[closing.state.group_id] = self.engine.attach(closing.samples)
        self.processor.finish(step, attached, now_ms)
        for key, value in step.writes:
            if value is None:
                self.table.pop(key, None)
            else:
                self.table[key] = value
        return step

    def tick(self, partition: int, now_ms: int) -> Step:
        """A timer tick of one raw partition (groups past their timeout close)."""
        from streams.processor import Message

        offset = self._ticks[partition] = self._ticks.get(partition, -1) + 1
        return self.step(Message(self.processor.ticks_topic, partition, offset, None, b""), now_ms)

    def open_states(self) -> list[GroupState]:
        from streams.groups import GROUP_PREFIX, GroupState

        return [
            s
            for k, v in self.table.items()
            if k.startswith(GROUP_PREFIX) and not (s := GroupState.from_bytes(v)).closed
        ]

    def flush(self, last_ms: int) -> list[tuple[int, Step]]:
        """Close the groups still open as their timeout would, after ``last_ms``."""
        now = last_ms + int(self.config.streams.groups.timeout_s * 1000) + 1
        partitions = sorted({s.partition for s in self.open_states()})
        return [(p, self.tick(p, now)) for p in partitions]


def rerun_stream(
    config: RollstreamConfig,
    records: Sequence[ReplayRecord],
    options: StreamRerunOptions,
    client_config: Mapping[str, str],
    renderer: Renderer,
) -> StreamRerunResult:
    """Process ``records`` with the stream's logic and print what it would produce."""
    from streams.groups import GroupState, group_key
    from streams.processor import Message
    from streams.staleness import VersionTracker

    console = renderer.console
    streams = config.streams
    version = options.trainer_version
    if version is None:
        version = latest_announced(client_config, streams.topics.versions, options.run_id)
    tracker = VersionTracker()
    if version != NO_VERSION:
        tracker.observe(version)
    replay = StreamReplay(config, options.run_id, tracker)
    console.rule(
        f"rerun stream: run {options.run_id}, trainer version "
        f"{'unknown (all admitted)' if version == NO_VERSION else version}, staleness "
        f"{streams.staleness.mode} (max {streams.staleness.max_staleness}), old logits "
        f"{streams.old_logits.mode}"
    )

    def sends_of(step: Step) -> list[Send]:
        for group_id, trace in step.operator_trace.items():
            decisions = ", ".join(f"{name} → {decision}" for name, decision in trace)
            renderer.say(f"operators on group {group_id}: {decisions}")
        return step.sends

    outputs: list[tuple[ReplayRecord | None, list[Send]]] = []
    last_ms = 0
    for record in records:
        if record.group is not None or record.announcement is not None:
            renderer.say(f"{record.where}: a {record.kind} is not a stream input; skipped")
            continue
        headers = tuple((k, v if v is not None else b"") for k, v in record.headers)
        msg = Message(
            record.topic, record.partition, record.offset, record.key, record.value, headers
        )
        sends = sends_of(replay.step(msg, record.timestamp_ms))
        last_ms = max(last_ms, record.timestamp_ms)
        outputs.append((record, sends))
        _print_sends(renderer, record.where, sends, replay.table, record)

    if options.flush:
        for partition, step in replay.flush(last_ms):
            sends = sends_of(step)
            outputs.append((None, sends))
            _print_sends(renderer, f"timeout of partition {partition}", sends, replay.table, None)
    still_open = sorted(s.group_id for s in replay.open_states())
    for group_id in still_open:
        state = GroupState.from_bytes(replay.table[group_key(group_id)])
        renderer.say(
            f"open: group {group_id} holds {len(state.samples)} of {state.group_size} samples "
            f"({len(state.dropped)} dropped); --flush closes it as a timeout would"
        )
    sent = [s for _, sends in outputs for s in sends]
    counts = {t: sum(1 for s in sent if s.topic == t) for t in sorted({s.topic for s in sent})}
    renderer.say(f"rerun stream: {len(outputs)} step(s), produced {counts or 'nothing'}")
    return StreamRerunResult(outputs, still_open, version)


def _print_sends(
    renderer: Renderer,
    where: str,
    sends: Sequence[Send],
    table: Mapping[bytes, bytes],
    record: ReplayRecord | None,
) -> None:
    from schemas.codec import DEAD_LETTER_HEADER, FILTERED_HEADER, STALE_HEADER
    from schemas.control import (
        DeadLetter,
        FilteredGroup,
        StaleRecord,
    )
    from streams.groups import GroupState, group_key

    if not sends:
        traj = record.trajectory if record is not None else None
        raw = table.get(group_key(traj.group_id)) if traj is not None else None
        if raw is not None:
            state = GroupState.from_bytes(raw)
            renderer.say(
                f"{where} → joins group {state.group_id} "
                f"({len(state.samples)}/{state.group_size} samples, "
                f"{len(state.dropped)} dropped)"
            )
        else:
            renderer.say(f"{where} → nothing produced")
        return
    for send in sends:
        keys = {k for k, _ in send.headers}
        if DEAD_LETTER_HEADER in keys:
            letter = DeadLetter.from_headers(send.headers)
            renderer.say(f"{where} → DLQ {send.topic}: {letter.reason}: {letter.detail}")
        elif STALE_HEADER in keys:
            stale = StaleRecord.from_headers(send.headers)
            renderer.say(
                f"{where} → stale {send.topic}: staleness {stale.staleness} > "
                f"{stale.max_staleness} at trainer version {stale.trainer_version}"
            )
        elif not send.value.startswith(b"RSTM"):  # prompts.stats: a JSON document
            renderer.say(f"{where} → prompt statistics {send.topic}: {send.value.decode()}")
        elif FILTERED_HEADER in keys:
            note = FilteredGroup.from_headers(send.headers)
            renderer.say(
                f"{where} → filtered {send.topic}: group {note.group_id} by operator "
                f"{note.operator} ({note.reason})"
            )
        else:
            group = decode_group(send.value)
            renderer.say(f"{where} → scored {send.topic}: group {group.group_id}")
            renderer.group(group)


# --- train ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainRerunOptions:
    weights_version: int | None = None  # None: the initial weights of [trainer.model]
    dtype: Literal["float32", "bfloat16"] | None = None  # None: bf16 if trainer.engine.bf16
    groups_per_micro_batch: int | None = None  # None: trainer.batch.max_groups
    run_id: str = "default"


@dataclasses.dataclass
class TrainRerunResult:
    micro_batches: list[dict[str, float]]
    combined: dict[str, float]
    skipped: list[tuple[str, str]]  # (trajectory id, why)
    weights: str


@dataclasses.dataclass
class Policy:
    """The weights a rerun scores with, and what the trainer would use besides."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    pad_id: int
    vocab_size: int
    max_length: int
    description: str


def load_policy(
    config: RollstreamConfig, trainer: TrainerConfig, options: TrainRerunOptions
) -> Policy:
    """``[trainer.model]`` at initialisation, or with a stored version's weights."""
    import torch

    dtype = getattr(torch, options.dtype or ("bfloat16" if trainer.engine.bf16 else "float32"))
    # float32 first, cast after any stored weights are loaded: the trainer's order
    model = load_model(trainer.model.spec, "float32", cache_dir=config.cache_dir)
    reference = None
    if trainer.loss.kl_coef > 0:
        reference = load_model(trainer.model.spec, dtype, cache_dir=config.cache_dir)
    description = f"initial {trainer.model.spec} weights"
    if options.weights_version is not None:
        from core.logprobs import params_for
        from streams.snapshots import FollowerSource
        from weights.follower import WeightFollower
        from weights.store import WeightStore

        store = WeightStore.from_config(resolved_s3(config), options.run_id, config.policy)
        source = FollowerSource(
            store, make_follower=lambda s: WeightFollower.from_config(s, resolved_weights(config))
        )
        params = params_for(model, source.load(options.weights_version), torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(params[name])
        description = f"version {options.weights_version} of run {options.run_id}"
    model = cast_parameters(model, dtype).eval()  # as DeepSpeed casts the trainer's
    cfg = model.config
    pad = trainer.model.pad_token_id
    if pad is None:
        pad = getattr(cfg, "pad_token_id", None) or 0
    return Policy(
        model=model,
        reference=reference,
        pad_id=int(pad),
        vocab_size=int(cfg.vocab_size),
        max_length=int(trainer.model.max_length or cfg.max_position_embeddings),
        description=f"{description} ({str(dtype).removeprefix('torch.')})",
    )


def loss_terms(
    trainer: TrainerConfig, trajectories: Sequence[Trajectory], policy: Policy
) -> dict[str, float]:
    """The metrics the trainer's micro-step reports for ``trajectories`` (one micro-batch)."""
    import torch

    from consumers.batching import pack, response_logprobs
    from consumers.losses import compute_loss
    from consumers.step import anchored_inputs, needs_prox, step_metrics

    batch = pack(trajectories)
    temperature = trainer.model.temperature
    with torch.no_grad():
        logp_new = response_logprobs(
            policy.model, batch, temperature=temperature, pad_id=policy.pad_id
        )
        logp_ref = None
        if policy.reference is not None:
            logp_ref = response_logprobs(
                policy.reference, batch, temperature=temperature, pad_id=policy.pad_id
            )
        # A fresh EWMA is the current weights: logp_prox = logp_new (see the module doc).
        logp_prox = logp_new if needs_prox(trainer, batch) else None
        inputs, anchored = anchored_inputs(
            trainer, batch, logp_new, logp_prox=logp_prox, logp_ref=logp_ref
        )
        out = compute_loss(trainer.loss, inputs)
    return step_metrics(out.metrics, batch, anchored, logp_new)


def trainable(
    trainer: TrainerConfig, trajectories: Sequence[Trajectory], policy: Policy
) -> tuple[list[Trajectory], list[tuple[str, str]]]:
    """The records the trainer would train, and why the others would not be."""
    from schemas.trainable import check_trainable
    from schemas.validation import ValidationLimits

    route = trainer.approx.route if trainer.needs_old_logp() else "infer"
    limits = ValidationLimits(vocab_size=policy.vocab_size, max_total_tokens=policy.max_length)
    kept: list[Trajectory] = []
    skipped: list[tuple[str, str]] = []
    for traj in trajectories:
        defect = check_trainable(traj, limits)
        why = None if defect is None else str(defect)
        if why is None and route == "drop" and traj.old_logits_status != OldLogitsStatus.EXACT:
            why = f"approx.route = drop and logp_old is {traj.old_logits_status}"
        if why is None:
            kept.append(traj)
        else:
            skipped.append((traj.trajectory_id, why))
    return kept, skipped


def rerun_train(
    config: RollstreamConfig,
    records: Sequence[ReplayRecord],
    options: TrainRerunOptions,
    renderer: Renderer,
) -> TrainRerunResult:
    """One trainer step's loss terms over the scored groups in ``records``."""
    from consumers.step import combine_metrics

    console = renderer.console
    trainer = config.trainer
    groups: list[list[Trajectory]] = []
    for record in records:
        if record.group is not None:
            groups.append(list(record.group.samples))
        elif record.trajectory is not None and record.trajectory.advantage is not None:
            groups.append([record.trajectory])  # a trajectory already scored (with advantage)
        else:
            renderer.say(f"{record.where}: a {record.kind} without advantages; skipped")
    policy = load_policy(config, trainer, options)
    size = options.groups_per_micro_batch or trainer.batch.max_groups
    console.rule(
        f"rerun train: loss {trainer.loss.type}, {policy.description}, "
        f"{len(groups)} group(s), {size} per micro-batch"
    )
    parts: list[dict[str, float]] = []
    skipped: list[tuple[str, str]] = []
    for start in range(0, len(groups), size):
        chunk = [t for group in groups[start : start + size] for t in group]
        kept, why = trainable(trainer, chunk, policy)
        skipped.extend(why)
        for trajectory_id, reason in why:
            renderer.say(f"not trained: {trajectory_id}: {reason}")
        if not kept:
            continue
        metrics = loss_terms(trainer, kept, policy)
        parts.append(metrics)
        renderer.metrics(f"micro-batch {len(parts)} ({len(kept)} trajectories)", metrics)
    combined = combine_metrics(parts) if parts else {}
    if len(parts) > 1:
        renderer.metrics("step (micro-batches combined)", combined)
    if not parts:
        renderer.say("rerun train: nothing trainable among the selected records")
    return TrainRerunResult(parts, combined, skipped, policy.description)
