"""The trainer's driver loop: consume → train → publish → checkpoint → commit.

Reads like pseudocode on purpose (``Trainer.run``)::

    restore the last checkpoint (weights, optimiser, step, Kafka offsets, EWMA)
    publish version `step` if the store has none
    until stopped or max_steps:
        gather grad_accum_steps micro-batches of whole groups from rollouts.scored,
            setting aside groups more than staleness.max_staleness behind `step`
        one optimiser step (consumers.step)                  -> version step+1
        publish every publish.every steps                    (S3, then policy.versions,
                                                              with groups per step and window)
        checkpoint every checkpoint.every steps:
            flush the DLQ, save (offsets + ledger + stale groups inside), mark LATEST,
            route the stale groups to rollouts.stale, append the ledger,
            commit the offsets to Kafka
        metrics: JSONL, Prometheus, progress line
        guards: judge each step's signals; warn, pause producers, stop, or roll back
            to the last healthy checkpoint (consumers.guards)
    on stop (SIGTERM/SIGINT, max_steps): finish the step, checkpoint, close

With several data-parallel ranks (a launcher's ``WORLD_SIZE`` > 1) rank 0 runs the loop
above and hands each step's records out to the ranks (``consumers.ranks``); the others
follow its orders: train their share, save checkpoints together, stop.

Crash safety: offsets are committed only after the checkpoint that covers them is
durable, and a restart seeks to the offsets stored in that checkpoint, so every record
is trained into the surviving weights exactly once (``consumers.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from consumers.batching import StaleGroup, TopicPartition, merge_offsets
from consumers.checkpoint import (
    CheckpointManager,
    LedgerStep,
    Rollback,
    TrainerState,
    TrainingLedger,
)
from consumers.config import CheckpointConfig, TrainerConfig, checkpoint_dir, ledger_path
from consumers.failpoint import FAILPOINT_ENV as FAILPOINT_ENV  # the crash tests set it
from consumers.failpoint import failpoint
from consumers.guards import Decision, Guards, GuardState, GuardStop, Trip, measure
from consumers.metrics import MetricsSink, data_metrics
from consumers.ranks import (
    CheckpointOrder,
    RankChannel,
    StopOrder,
    TrainOrder,
    WeightsOrder,
    split_for_ranks,
    token_imbalance,
)
from consumers.recent import RecentGroups
from core.config import SharedConfig
from core.models import adapter_tensor_names, load_model
from core.tracking import Tracker
from schemas.trajectory import Trajectory

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from consumers.step import StepResult
    from weights.announce import Announcer

log = logging.getLogger(__name__)

Gathered = tuple[
    list[list[Trajectory]],
    dict[TopicPartition, int],
    list[StaleGroup],
    set[str],
    set[str],
    list[tuple[str, list[str]]],
]
"""What ``Trainer._gather`` returns (see there)."""


def trainer_announcer(
    kafka: Mapping[str, str], config: TrainerConfig, signing_key: Ed25519PrivateKey | None = None
) -> Announcer:
    """The trainer's announcer: every version it announces carries its groups per step and
    staleness window, from which producers derive their admission credit, signed with the
    run's key (if it has one) so that producers can tell them from a forged pace."""
    from weights.announce import Announcer

    return Announcer(
        kafka,
        topic=config.topics.versions,
        groups_per_step=config.groups_per_step(),
        max_staleness=config.staleness.max_staleness,
        signing_key=signing_key,
    )


def sharing_producers(recent: Iterable[set[str]], gone: set[str]) -> int | None:
    """How many producers share the trainer's pace: those with groups trained over the
    recent steps, less those whose heartbeat says they left or went silent (their last
    groups may still be trained, but they start no more, so the others' shares grow at
    once). None when there are none."""
    return len(set().union(*recent) - gone) or None


def checkpoint_config(shared: SharedConfig, trainer: TrainerConfig) -> CheckpointConfig:
    """``trainer.checkpoint`` with its directory resolved (``checkpoint_dir``)."""
    return trainer.checkpoint.model_copy(update={"dir": checkpoint_dir(shared, trainer)})


@dataclass
class TrainSummary:
    """What a ``run`` did."""

    step: int
    steps_this_run: int
    trained: int
    dead_letters: int
    stale_groups: int
    checkpoints: int
    published: list[int]
    refused_groups: int = 0  # read again after being trained: not trained twice


class Trainer:
    """Owns the engine, the Kafka source, the publisher and the sinks of one run."""

    def __init__(self, shared: SharedConfig, trainer: TrainerConfig) -> None:
        """``shared``: the run's resolved shared sections (Kafka's address known);
        ``trainer``: the ``[trainer]`` section. Publishing needs ``publish.every`` or
        ``publish.initial``, heartbeats ``presence.enabled``."""
        self.shared = shared
        self.config = trainer
        self.stop_event = threading.Event()
        self.step = 0
        self.offsets: dict[TopicPartition, int] = {}
        self.pending_ledger: list[LedgerStep] = []
        self.last_checkpoint_step = 0
        self.checkpoint_s: float | None = None  # the last checkpoint's seconds, not yet in a row
        # a micro-batch with nothing to train is an error here; a fork of a restream may
        # have one (``consumers.fork.ForkPlan.partial``)
        self.empty_micro_batches_ok = False
        self.pending_stale: list[StaleGroup] = []
        self.recent = RecentGroups()  # groups trained into the weights lately (checkpointed)
        self.pending_refused: list[tuple[int, list[str]]] = []
        self.set_aside = False  # offsets moved past records set aside, not checkpointed yet
        window = self.config.staleness.max_staleness or 0
        self.recent_producers: deque[set[str]] = deque(maxlen=window + 1)
        self.restored: TrainerState | None = None
        self.summary = TrainSummary(0, 0, 0, 0, 0, 0, [])
        self.beacon: Any = None  # core.presence.Beacon of rank 0
        self.guards = Guards(trainer.guards)
        self.pending_rollbacks: list[Rollback] = []  # since the previous checkpoint
        self.guard_stop: str | None = None  # why a guard stopped the run
        self.presence: Any = None  # core.presence.Poller of the run's heartbeats

    @property
    def kafka(self) -> dict[str, str]:
        """librdkafka settings of the run's cluster (only rank 0 talks to Kafka)."""
        return self.shared.kafka.client_config()

    # --- setup --------------------------------------------------------------------------

    def _build(self) -> None:
        """Engine, loss runner, checkpoints, Kafka, publisher, sinks (heavy imports here)."""
        import torch

        from consumers.step import StepRunner
        from consumers.train_engine import TrainEngine, rank, world_size

        cfg = self.config
        torch.manual_seed(cfg.engine.seed)
        if cfg.engine.deterministic:  # the same records give the same weights, bit for bit
            torch.use_deterministic_algorithms(True)
            torch.set_num_threads(1)
        # float32 master weights; DeepSpeed casts the module for bf16 training
        model = load_model(
            cfg.model.spec, "float32", cache_dir=self.shared.cache_dir, lora=self.shared.lora
        )
        # a LoRA run's versions are its adapter on one base (weights.writer)
        self.adapter_tensors = adapter_tensor_names(model) if self.shared.lora else None
        model_cfg = model.config
        self.vocab_size = int(model_cfg.vocab_size)
        self.max_length = int(cfg.model.max_length or model_cfg.max_position_embeddings)
        pad = cfg.model.pad_token_id
        if pad is None:
            pad = getattr(model_cfg, "pad_token_id", None) or 0
        self.engine = TrainEngine(
            model, cfg.engine, frozen_copies=StepRunner.frozen_copies_needed(cfg)
        )
        self.rank, self.world = rank(), world_size()
        if self.world > 1 and cfg.ppo.minibatches > 1:
            raise ValueError(
                "[trainer.ppo] minibatches > 1 needs a world of one rank: the ranks' "
                "shares could split into different numbers of optimiser steps"
            )
        if self.world > 1 and cfg.guards.rolls_back():
            raise ValueError(
                "[trainer.guards] action = 'rollback' needs a world of one rank (the other "
                "ranks would have to rewind too); use stop or pause"
            )
        self.channel = RankChannel(self.rank, self.world) if self.world > 1 else None
        self.runner = StepRunner(self.engine, cfg, pad_id=int(pad))
        self.checkpoints = CheckpointManager(checkpoint_config(self.shared, self.config))
        if self.rank != 0:
            return  # Kafka, the ledger, publishing and metrics are rank 0's
        log.info("trainer rank 0 of a world of %d", self.world)
        # always kept (where `rollstream audit` looks with the same config), on every
        # way to start a trainer, not only where `up` names a file
        self.ledger: TrainingLedger | None = TrainingLedger(
            ledger_path(self.shared, cfg), fsync=cfg.checkpoint.fsync
        )
        tracker = Tracker.for_role(self.shared, "trainer")
        self.sink = MetricsSink(
            cfg.metrics_file, progress=cfg.progress, total_steps=cfg.max_steps, tracker=tracker
        )
        if cfg.prometheus_port is not None:
            port = self.sink.serve(cfg.prometheus_port, cfg.prometheus_host)
            log.info("prometheus metrics on %s:%d", cfg.prometheus_host, port)

    def _restore(self) -> None:
        state = self.checkpoints.load(self.engine)
        if state is None:
            log.info("no checkpoint in %s: starting at step 0", self.checkpoints.dir)
            return
        self.step = self.last_checkpoint_step = state.step
        self.offsets = dict(state.offsets)
        self.recent = RecentGroups(state.recent_groups)
        self.runner.load_state_dict(state.runner)
        self._restore_guards(state)
        if self.engine.global_steps != state.step:
            raise RuntimeError(
                f"checkpoint step {state.step} != DeepSpeed global_steps {self.engine.global_steps}"
            )
        self.restored = state
        log.info(
            "restored step %d; resuming at offsets %s",
            state.step,
            {f"{t}[{p}]": o for (t, p), o in sorted(self.offsets.items())},
        )

    def _settle_restored(self) -> None:
        """Finish the last checkpoint's work a crash may have cut short: route its stale
        groups (those of steps the ledger lacks; without a ledger, all of them: at least
        once) and write the ledger lines it has and the ledger lacks."""
        state = self.restored
        if state is None:
            return
        last = self.ledger.last_step if self.ledger is not None else -1
        unrouted = [g for g in state.stale if g.step > last]
        if unrouted:
            self.source.route_stale(unrouted)
            log.warning("routed %d stale group(s) of the last checkpoint again", len(unrouted))
        if self.ledger is not None:
            written = self.ledger.append(state.ledger, state.stale, state.refused)
            if written:
                log.warning("ledger: wrote %d step(s) the checkpoint had and it lacked", written)
            if self.ledger.append_rollbacks(state.rollbacks):
                log.warning("ledger: wrote the rollback(s) the checkpoint had and it lacked")
        self._announce_pause()  # a pause kept in the checkpoint holds on
        self.restored = None

    def _connect(self) -> None:
        from consumers.source import ScoredSource, TrainableRecords

        cfg = self.config
        self._ensure_topics()
        presence = self.shared.presence
        if presence.enabled:
            from core.presence import Beacon

            self.beacon = Beacon(
                self.kafka,
                presence.topic,
                run=self.shared.run_id,
                role="trainer",
                instance=cfg.topics.group_instance_id or None,
                interval_s=presence.interval_s,
                detail=lambda: {"step": self.step, "world": self.world},
            ).start()
            from core.presence import Poller, read_presence

            self.presence = Poller(
                lambda: read_presence(self.kafka, presence.topic, self.shared.run_id),
                presence.interval_s,
            ).start()
        self.source = ScoredSource(
            self.kafka,
            cfg.topics,
            cfg.batch,
            cfg.retry,
            accepts=TrainableRecords(
                run_id=self.shared.run_id,
                vocab_size=self.vocab_size,
                max_length=self.max_length,
                policy=self.shared.policy,
            ),
            start_offsets=self.offsets,
            on_dead_letter=self.sink.record_dlq,
        )
        self._start_publisher()

    def _start_publisher(self) -> None:
        """The publisher of this run's weight lineage (None when nothing is published),
        after publishing version ``step`` if the store has none."""
        cfg = self.config
        self.publisher = None
        if cfg.publish.every or cfg.publish.initial:
            from consumers.weight_publisher import Publisher
            from weights.store import WeightStore
            from weights.trust import Trust
            from weights.writer import DeltaWriter

            store = WeightStore.from_config(self.shared.s3, self.shared.run_id, self.shared.policy)
            trust = Trust.from_config(self.shared.weights)  # no key, no training (unless allowed)
            writer = DeltaWriter.from_config(
                store, self.shared.weights, adapter_tensors=self.adapter_tensors
            )
            writer.before_claim = lambda version: failpoint("mid_publish", version)
            announcer = (
                trainer_announcer(self.kafka, cfg, writer.signing_key)
                if cfg.publish.announce
                else None
            )
            self.publisher = Publisher(
                writer,
                cfg.publish,
                cfg.retry,
                announcer,
                keep_versions=self.shared.weights.keep_versions,
                orphan_grace_s=self.shared.weights.orphan_grace_s,
                trust=trust,
            )
            first = self.publisher.resume(self.step, self._full_weights)
            if first is not None:
                self.summary.published.append(first.version)

    def _ensure_topics(self) -> None:
        from confluent_kafka import KafkaException

        from core.retry import retrying
        from infra.topics import ensure_topics
        from schemas.topics import POLICY_VERSIONS, ROLLOUTS_DLQ, ROLLOUTS_SCORED, ROLLOUTS_STALE

        names = self.config.topics
        specs = [
            dataclasses.replace(ROLLOUTS_SCORED, name=names.scored),
            dataclasses.replace(ROLLOUTS_DLQ, name=names.dlq),
            dataclasses.replace(ROLLOUTS_STALE, name=names.stale),
            dataclasses.replace(POLICY_VERSIONS, name=names.versions),
        ]
        for attempt in retrying(self.config.retry, (KafkaException,), "ensure topics"):
            with attempt:
                ensure_topics(self.kafka, specs, self.shared.kafka)

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> TrainSummary:
        """Train until ``max_steps`` or a stop request; always ends on a checkpoint. Raises
        ``GuardStop`` after it when a guard stopped the run (``consumers.guards``)."""
        self._build()
        finished = False
        try:
            self._restore()  # every rank: DeepSpeed's load is collective
            if self.rank != 0:
                self._follow()
            else:
                self._connect()
                self._settle_restored()
                max_steps = self.config.max_steps
                while not self.stop_event.is_set() and (max_steps is None or self.step < max_steps):
                    if not self._one_step():
                        break
                self._checkpoint_if_behind()
                if self.channel is not None:
                    self.channel.scatter([StopOrder()] * self.world)
            finished = True
        finally:
            self._close()
            if self.channel is not None:
                from consumers.train_engine import shutdown_distributed

                shutdown_distributed(together=finished)
        self.summary.step = self.step
        if self.guard_stop is not None:
            raise GuardStop(self.guard_stop)
        return self.summary

    def _one_step(self) -> bool:
        """Gather, train, publish, maybe checkpoint; False when stopped while gathering."""
        cfg = self.config
        started = time.perf_counter()
        gathered = self._gather(cfg.engine.grad_accum_steps)
        if gathered is None:
            return False
        micro_batches, covered, stale, relaxed, consumed, refused = gathered
        computed = time.perf_counter()
        version = self.step  # the weights being trained are version `step`
        if self.channel is None:
            result = self.runner.train_step(
                micro_batches,
                step=self.step,
                relaxed=relaxed,
                empty_ok=self.empty_micro_batches_ok,
            )
        else:
            result = self._train_across_ranks(micro_batches, relaxed)
        trained_at = time.perf_counter()
        self.step += 1
        self.offsets = merge_offsets(self.offsets, covered)
        ids = [t.trajectory_id for t in result.trained]
        self._count_producers(result.trained)
        composition = [[t.trajectory_id for t in batch] for batch in micro_batches]
        self.pending_ledger.append(LedgerStep(self.step, ids, composition, sorted(relaxed)))
        for group_id in consumed:
            self.recent.add(group_id)
        if refused:
            self.pending_refused.append((self.step, [t for g in refused for t in g[1]]))
            self.summary.refused_groups += len(refused)
        self.pending_stale.extend(stale)
        self.summary.stale_groups += len(stale)
        decision, guard_metrics = self._judge(result)
        stop_reason = None
        if decision.action == "stop" and decision.main is not None:
            stop_reason = decision.main.reason()
        elif decision.action == "rollback" and decision.main is not None:
            stop_reason = self._rollback(decision.main)  # the weights published next: healthy
            guard_metrics["guards/rollbacks"] = float(self.guards.state.rollbacks)

        metrics: dict[str, float] = {"step": float(self.step), "version": float(version)}
        metrics.update(data_metrics(result.trained, version))
        metrics.update(result.metrics)
        metrics.update(guard_metrics)
        tokens = sum(t.num_prompt_tokens + t.num_response_tokens for t in result.trained)
        compute_s = trained_at - computed
        metrics["time/unix_s"] = time.time()  # wall clock, for reports over time
        metrics["time/wait_s"] = computed - started
        metrics["time/step_s"] = compute_s
        metrics["throughput/tokens_per_s"] = tokens / compute_s if compute_s > 0 else 0.0
        metrics["data/dropped_approx"] = float(result.dropped)
        metrics["data/dlq_total"] = float(self.source.dlq.sent)
        metrics["data/stale_groups"] = float(len(stale))
        metrics["data/over_window_trajectories"] = float(len(relaxed))
        metrics["data/stale_total"] = float(self.summary.stale_groups)
        metrics["data/refused_groups"] = float(len(refused))
        metrics["data/refused_total"] = float(self.summary.refused_groups)
        if stale:
            metrics["data/stale_staleness_max"] = float(max(g.staleness for g in stale))
        lag = self.source.lag(self.offsets)
        for partition, records in lag.items():
            metrics[f"lag/partition/{partition}"] = float(records)
        if lag:
            metrics["lag/total"] = float(sum(lag.values()))

        if stop_reason is None and self.publisher is not None and self.publisher.due(self.step):
            published = self.publisher.publish(self.step, self._full_weights())
            metrics["time/publish_s"] = published.seconds
            self.summary.published.append(self.step)
        if self.publisher is not None:
            metrics["weights/forged_claims_total"] = float(self.publisher.forged_claims)
        if self.checkpoint_s is not None:  # the checkpoint after the previous step
            metrics["time/checkpoint_s"] = self.checkpoint_s
            self.checkpoint_s = None
        # written before the checkpoint: a crash after it trains the step again and writes
        # its row again (the last row of a step wins), never leaves a step without one
        self.sink.emit(metrics, result.trained)
        if self.step % cfg.checkpoint.every == 0 and self.last_checkpoint_step != self.step:
            self.checkpoint_s = self._checkpoint()
        self.summary.steps_this_run += 1
        self.summary.trained += len(result.trained)
        if stop_reason is not None:  # `run` checkpoints, stops the ranks, then raises
            self.guard_stop = stop_reason
            return False
        return True

    # --- guards -------------------------------------------------------------------------

    def _judge(self, result: StepResult) -> tuple[Decision, dict[str, float]]:
        """The guards' signals of the step just trained, their decision and metrics; the
        pause (or its end) goes out with the next announced version."""
        guards = self.guards
        signals = measure(
            result.trained,
            result.metrics,
            mismatch_metric=self.config.guards.mismatch.metric,
            since_version=guards.state.since_version,
        )
        decision = guards.observe(self.step, signals)
        for trip in decision.trips:
            log.warning("%s", trip.reason())
        self._announce_pause()
        return decision, guards.metrics(signals, decision)

    def _announce_pause(self) -> None:
        announcer = self.publisher.announcer if self.publisher is not None else None
        if announcer is not None:
            announcer.paused = self.guards.pause_reason()

    def _rollback(self, trip: Trip) -> str | None:
        """Rewind the weights, optimiser and EWMA to the newest healthy checkpoint older
        than the trip's onset, with the rollback's learning rate and seed, and checkpoint
        at once (the rollback in it, then in the ledger); the step count and the offsets go
        on. Returns why the run must stop instead, or None."""
        import torch

        kept = self.checkpoints.kept()
        target = self.guards.rollback_target(trip, kept)
        if target is None:
            return (
                f"{trip.reason()}; no healthy checkpoint older than version "
                f"{trip.onset_version} is kept to roll back to ([trainer.checkpoint] keep)"
            )
        state = self.checkpoints.load_tag(self.engine, target)
        self.runner.load_state_dict(state.runner)
        self.guards.rolled_back(self.step, kept, state.step)
        self.engine.set_peak_lr(self.config.engine.lr * self.guards.lr_factor())
        self.runner.seed_shift = self.guards.seed_shift()
        torch.manual_seed(self.config.engine.seed + self.runner.seed_shift)
        number = self.guards.state.rollbacks
        self.pending_rollbacks.append(
            Rollback(number, self.step, state.step, target, trip.guard, trip.reason())
        )
        log.warning(
            "rollback %d: weights of step %d (%s) resume after step %d, lr x%g, seed +%d",
            number,
            state.step,
            target,
            self.step,
            self.guards.lr_factor(),
            self.runner.seed_shift,
        )
        self._announce_pause()
        self.checkpoint_s = self._checkpoint()
        return None

    def _restore_guards(self, state: TrainerState) -> None:
        """The guards' memory from the checkpoint; the checkpoint itself is a rollback
        target if it was saved while every signal was normal."""
        import torch

        guard_state = GuardState.from_state(state.guards)
        latest = self.checkpoints.latest()
        if latest is not None and guard_state.healthy():
            guard_state.healthy_tags.append(latest[0])
        self.guards = Guards(self.config.guards, guard_state)
        self.runner.seed_shift = self.guards.seed_shift()
        if self.runner.seed_shift:
            torch.manual_seed(self.config.engine.seed + self.runner.seed_shift)

    # --- ranks --------------------------------------------------------------------------

    def _train_across_ranks(
        self, micro_batches: list[list[Trajectory]], relaxed: set[str]
    ) -> StepResult:
        """Rank 0's side of a step: every micro-batch split over the ranks by tokens,
        each rank's share sent, its own trained, every rank's metrics combined."""
        from consumers.step import StepResult, combine_metrics

        assert self.channel is not None
        kept = [self.runner.select(batch)[0] for batch in micro_batches]
        dropped = sum(len(b) for b in micro_batches) - sum(len(b) for b in kept)
        splits = [split_for_ranks(batch, self.world) for batch in kept]
        orders = [
            TrainOrder(self.step, [split[r] for split in splits], relaxed)
            for r in range(self.world)
        ]
        own = self.channel.scatter(orders)
        assert isinstance(own, TrainOrder)
        metrics = self._train_order(own)
        parts = self.channel.gather_metrics(metrics)
        assert parts is not None
        combined = combine_metrics([p for p in parts if p])
        for name in ("grad/norm", "grad/norm_max", "optim/lr", "ppo/optimizer_steps"):
            if name in metrics:
                combined[name] = metrics[name]  # the same on every rank
        combined["ranks/world"] = float(self.world)
        combined["ranks/token_imbalance"] = max(token_imbalance(split) for split in splits)
        combined["ranks/empty_shares"] = float(
            sum(not share for split in splits for share in split)
        )
        trained = [t for batch in kept for t in batch]
        return StepResult(metrics=combined, trained=trained, dropped=dropped)

    def _train_order(self, order: TrainOrder) -> dict[str, float]:
        """One rank's share of a step (an empty share: a zero-gradient micro-step, so the
        gradient all-reduce has every rank)."""
        result = self.runner.train_step(
            order.micro_batches, step=order.step, relaxed=order.relaxed, empty_ok=True
        )
        return result.metrics

    def _follow(self) -> None:
        """Ranks other than 0: do what rank 0 says until it says stop."""
        assert self.channel is not None
        while True:
            order = self.channel.scatter([])
            if isinstance(order, TrainOrder):
                self.channel.gather_metrics(self._train_order(order))
                self.step = order.step + 1
            elif isinstance(order, CheckpointOrder):
                self.checkpoints.save(self.engine, order.state)
            elif isinstance(order, WeightsOrder):
                self.engine.state_dict()
            elif isinstance(order, StopOrder):
                return

    def _full_weights(self) -> dict[str, Any]:
        """The trained weights on rank 0; under ZeRO-3 every rank takes part."""
        if self.channel is not None and self.config.engine.zero_stage == 3:
            self.channel.scatter([WeightsOrder()] * self.world)
        return self.engine.state_dict()

    def _count_producers(self, trained: list[Trajectory]) -> None:
        """Producers whose groups were trained over the last window + 1 steps and that
        have not left (heartbeats): they share this trainer's pace (announced with each
        version, ``producers.rollout.worker``)."""
        self.recent_producers.append({t.producer_id for t in trained})
        announcer = self.publisher.announcer if self.publisher is not None else None
        if announcer is not None:
            found = self.presence.latest if self.presence is not None else None
            gone = found.gone("producer") if found is not None else set()
            if found is not None:
                self.sink.record_roles(found)
            announcer.producers = sharing_producers(self.recent_producers, gone)

    def _gather(self, count: int) -> Gathered | None:
        """``count`` non-empty micro-batches, the offsets they (and any empty ones between
        them) cover, the groups set aside as too stale to train at version ``step``, the
        ids of records over the window trained with the relaxed clip (``over_window =
        "relaxed_clip"``), the ids of the groups consumed, and the groups refused as
        already trained (``consumers.recent``: ``(group id, sample ids)``); None if a stop
        was requested first (nothing is set aside then: the offsets do not move, and the
        same records are judged again)."""
        window = self.config.staleness.max_staleness
        limit = self.config.staleness.route_limit()
        batches: list[list[Trajectory]] = []
        covered: dict[TopicPartition, int] = {}
        stale: list[StaleGroup] = []
        relaxed: set[str] = set()
        consumed: set[str] = set()
        refused: list[tuple[str, list[str]]] = []
        while len(batches) < count:
            micro = self.source.next_micro_batch(self.stop_event)
            if micro is None:
                if not batches:
                    self._set_aside(covered, stale)
                return None
            covered = merge_offsets(covered, micro.next_offsets)
            fresh = []
            for group in micro.groups:
                if group.group_id in self.recent or group.group_id in consumed:
                    log.warning("group %s read again after it was trained: refused", group.group_id)
                    refused.append((group.group_id, [t.trajectory_id for t in group.trajectories]))
                    continue
                consumed.add(group.group_id)
                lag = group.staleness(self.step)
                if limit is not None and lag > limit:
                    stale.append(StaleGroup.of(group, self.step + 1, self.step, limit))
                    continue
                fresh.append(group)
                if window is not None and lag > window:  # over_window = relaxed_clip
                    relaxed.update(t.trajectory_id for t in group.trajectories)
            micro.groups = fresh
            kept, _dropped = self.runner.select(micro.trajectories)
            if kept:  # a micro-batch left empty (route=drop, stale) only advances the offsets
                batches.append(micro.trajectories)
        return batches, covered, stale, relaxed, consumed, refused

    def _set_aside(self, covered: dict[TopicPartition, int], stale: list[StaleGroup]) -> None:
        """At a stop, keep what was consumed without anything to train (groups over the
        window, or nothing kept): the final checkpoint routes those groups and moves the
        offsets past them, so a finished run leaves nothing in flight in the trainer.
        Their step is the next one, so a crash before that checkpoint's routing routes
        them again on restart."""
        if not covered and not stale:
            return
        self.offsets = merge_offsets(self.offsets, covered)
        self.pending_stale.extend(stale)
        self.summary.stale_groups += len(stale)
        self.set_aside = True

    # --- checkpoints --------------------------------------------------------------------

    def _checkpoint(self) -> float:
        """Durable checkpoint, then ledger, then Kafka commit; returns seconds taken."""
        started = time.perf_counter()
        self.source.flush_dead_letters()  # a DLQ record must be safe before its offset is
        state = TrainerState(
            step=self.step,
            offsets=dict(self.offsets),
            ledger=list(self.pending_ledger),
            runner=self.runner.state_dict(),
            last_published=None if self.publisher is None else self.publisher.last_version,
            stale=list(self.pending_stale),
            recent_groups=self.recent.to_state(),
            refused=list(self.pending_refused),
            guards=self.guards.state.to_state(),
            rollbacks=list(self.pending_rollbacks),
        )
        if self.channel is not None:
            self.channel.scatter([CheckpointOrder(state)] * self.world)
        tag = self.checkpoints.save(self.engine, state)
        self.guards.mark_checkpoint(tag, list(self.checkpoints.kept()))
        failpoint("after_checkpoint", self.step)
        if self.pending_stale:  # their offsets are durable now: never trained after a restart
            self.source.route_stale(self.pending_stale)
            failpoint("after_route_stale", self.step)
        if self.ledger is not None:
            self.ledger.append(self.pending_ledger, self.pending_stale, self.pending_refused)
            self.ledger.append_rollbacks(self.pending_rollbacks)
            failpoint("after_ledger", self.step)
        self.pending_ledger = []
        self.pending_refused = []
        self.pending_rollbacks = []
        self.pending_stale = []
        self.set_aside = False
        self.last_checkpoint_step = self.step
        self.summary.checkpoints += 1
        self.source.commit(self.offsets)
        seconds = time.perf_counter() - started
        log.info("checkpoint %s durable, offsets committed (%.2fs)", tag, seconds)
        return seconds

    def _checkpoint_if_behind(self) -> None:
        if self.step > self.last_checkpoint_step or self.set_aside:
            self._checkpoint()

    def _close(self) -> None:
        for name in ("source", "publisher"):
            part: Any = getattr(self, name, None)
            if part is not None:
                try:
                    part.close()
                except Exception:  # closing must not hide the error that got us here
                    log.exception("closing the %s failed", name)
        sink = getattr(self, "sink", None)
        if sink is not None:
            sink.close()
        if self.presence is not None:
            self.presence.close()
        if self.beacon is not None:
            self.beacon.leave()
        self.summary.dead_letters = self.source.dlq.sent if hasattr(self, "source") else 0

    # --- stopping -----------------------------------------------------------------------

    def request_stop(self, *_args: object) -> None:
        """Finish the current step, checkpoint, and return from ``run``."""
        if not self.stop_event.is_set():
            log.info("stop requested: finishing the current step")
        self.stop_event.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT request a clean stop (main thread only)."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            self.request_stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
