"""A fork's trainer: train again, step by step, exactly what a recorded run trained.

A run's trainer ledger (``consumers.checkpoint.TrainingLedger``) records each step's
composition: the samples handed to it, micro-batch by micro-batch, and those clipped with
the relaxed bounds. ``RecordedSteps`` reads the run's scored topic once (committed records
of that run only), keeps the samples the planned steps need, and hands each step its
micro-batches as the original trainer had them. ``ForkTrainer`` is the trainer with that
as its source: the same engine, loss, checkpoints, ledger, metrics and publishing, under
the fork's own run id (its own checkpoint directory, ledger, metrics file and weight
lineage), with nothing consumed from a group, routed, committed or announced. So a fork
never writes to the recorded run's topics, weights or checkpoints, and a fork killed at
any point resumes from its own last checkpoint like any trainer, training the same steps.
A fork that follows a run still training (``LedgerFollowing``) waits at the end of the
plan for the run's ledger to record more steps, reads their samples from where its last
read of the topic ended, and trains them too.

With nothing changed and the recorded run trained with ``[trainer.engine] deterministic``,
every version the fork publishes is the run's, bit for bit: the composition, the order and
the relaxed rows are the recorded ones, and a step's shuffle (``[trainer.ppo]``) is seeded
by its step number.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from consumers.batching import StaleGroup, TopicPartition
from consumers.checkpoint import LedgerStep, TrainingLedger
from consumers.config import TrainerConfig
from consumers.trainer import Gathered, Trainer
from core.config import SharedConfig
from schemas.trajectory import Trajectory

log = logging.getLogger(__name__)


class ForkError(ValueError):
    """The recorded run cannot be forked as asked (its ledger or topic lacks something)."""


@dataclass(frozen=True)
class ForkPlan:
    """What a fork trains: ``steps`` of run ``run_id``'s ledger (``from_step`` + 1 to
    ``to_step``, contiguous), read back from ``scored_topic``. ``partial``: the topic is a
    restream, which may lack some of the recorded samples (its settings set them aside);
    each step then trains those it has, and a micro-batch left empty is a zero-gradient
    micro-step, so step N still publishes version N."""

    run_id: str
    scored_topic: str
    steps: Sequence[LedgerStep]
    from_step: int
    to_step: int
    partial: bool = False

    @classmethod
    def of_ledger(
        cls,
        run_id: str,
        scored_topic: str,
        ledger: Sequence[LedgerStep],
        from_step: int = 0,
        to_step: int | None = None,
        partial: bool = False,
        following: bool = False,
    ) -> ForkPlan:
        """The plan for steps ``from_step`` + 1 .. ``to_step`` (default: the ledger's last).
        ``following``: the run is still training, so ``to_step`` may lie past the ledger's
        last step (the plan stops there for now) and the ledger may be empty."""
        if not ledger and not following:
            raise ForkError(f"run {run_id!r} has no trained step in its ledger")
        last = ledger[-1].step if ledger else 0
        wanted = last if to_step is None else to_step
        if not 0 <= from_step < wanted or (wanted > last and not following):
            raise ForkError(
                f"steps {from_step}..{wanted} are not within run {run_id!r}'s trained steps "
                f"0..{last} (from-step must be below to-step)"
            )
        to_step = min(wanted, last)
        if to_step < from_step:
            raise ForkError(f"run {run_id!r} has not trained step {from_step} yet")
        plan = cls(run_id, scored_topic, (), from_step, from_step, partial)
        return plan.extended([s for s in ledger if from_step < s.step <= to_step])

    def extended(self, steps: Sequence[LedgerStep]) -> ForkPlan:
        """This plan with the ledger's ``steps`` after ``to_step`` appended (contiguous)."""
        numbers = [s.step for s in steps]
        expected = list(range(self.to_step + 1, self.to_step + 1 + len(steps)))
        if numbers != expected:
            missing = sorted(set(expected) - set(numbers))
            raise ForkError(f"run {self.run_id!r}'s ledger lacks steps {missing[:10]}")
        to_step = numbers[-1] if numbers else self.to_step
        return ForkPlan(
            self.run_id,
            self.scored_topic,
            [*self.steps, *steps],
            self.from_step,
            to_step,
            self.partial,
        )

    def check_micro_batches(self, count: int) -> None:
        """``ForkError`` at the first planned step that did not train ``count`` micro-batches
        (the fork's ``grad_accum_steps``): checked before a fork writes anything."""
        for step in self.steps:
            trained = len(self.micro_batches(step))
            if trained != count:
                raise ForkError(self.accumulation_mismatch(step.step, trained, count))

    def accumulation_mismatch(self, step: int, trained: int, count: int) -> str:
        """What a fork says of a step whose micro-batches its accumulation does not fit."""
        return (
            f"step {step} of run {self.run_id!r} trained {trained} micro-batches; this "
            f"fork's [trainer.engine] grad_accum_steps is {count}"
        )

    @classmethod
    def ids_of(cls, steps: Sequence[LedgerStep]) -> set[str]:
        """The sample ids ``steps`` trained."""
        return {i for step in steps for batch in cls.micro_batches(step) for i in batch}

    @staticmethod
    def micro_batches(step: LedgerStep) -> list[list[str]]:
        """The step's micro-batches of sample ids (a line from before compositions were
        recorded: its trained samples as one micro-batch)."""
        return step.micro_batches if step.micro_batches is not None else [step.trajectory_ids]


@dataclass
class ScoredTopicTail:
    """Reads run ``run_id``'s samples from a scored topic, each call from where the last
    one ended (the whole topic at the first), as a reader of its own (``purpose``)."""

    client_config: Mapping[str, str]
    topic: str
    run_id: str
    purpose: str
    timeout_s: float
    position: dict[int, int] = field(default_factory=dict)  # partition -> next offset

    def read_new(self) -> Iterator[Trajectory]:
        """Every sample of the run's scored groups written since the last call, in the
        topic's order (a record that is no scored group was dead-lettered by the trainer:
        never trained)."""
        from confluent_kafka import Consumer

        from core.topic_reader import read_range, reader_config, whole_topic
        from schemas.group import decode_group

        consumer = Consumer(reader_config(self.client_config, self.purpose))
        try:
            ends = whole_topic(consumer, self.topic)
            plan = {p: (self.position.get(p, low), high) for p, (low, high) in ends.items()}
            for msg in read_range(consumer, self.topic, plan, self.timeout_s):
                try:
                    group = decode_group(msg.value() or b"")
                except Exception:
                    continue
                if group.run_id == self.run_id:
                    yield from group.samples
            self.position = {p: end for p, (_start, end) in plan.items()}
        finally:
            consumer.close()


def recorded_samples(
    client_config: Mapping[str, str], topic: str, run_id: str, purpose: str, timeout_s: float
) -> Iterator[Trajectory]:
    """Every sample of run ``run_id``'s scored groups on ``topic``, in the topic's order."""
    return ScoredTopicTail(client_config, topic, run_id, purpose, timeout_s).read_new()


@dataclass
class NoDeadLetters:
    """A fork reads records the recorded run already judged: none is dead-lettered."""

    sent: int = 0


@dataclass
class RecordedSteps:
    """The fork's source: each planned step's micro-batches, from the recorded topic.

    Offers what the trainer asks of its Kafka source besides gathering (dead letters,
    stale routing, offset commits, lag), as nothing: a fork consumes, routes and commits
    nothing."""

    plan: ForkPlan
    tail: ScoredTopicTail
    samples: dict[str, Trajectory] = field(default_factory=dict)
    # following a run: its samples read but not planned yet (the run's topic runs ahead
    # of its ledger, which is written at its checkpoints)
    unplanned: dict[str, Trajectory] | None = None
    dlq: NoDeadLetters = field(default_factory=NoDeadLetters)

    @classmethod
    def read(
        cls,
        client_config: Mapping[str, str],
        plan: ForkPlan,
        timeout_s: float = 60.0,
        following: bool = False,
    ) -> RecordedSteps:
        """Read ``plan.scored_topic`` to its current end and keep the samples the plan
        needs (``following``: the others of the run too, for the steps it records next);
        ``ForkError`` naming the steps whose samples the topic no longer holds (unless the
        plan is ``partial``: then it logs how many are missing)."""
        tail = ScoredTopicTail(client_config, plan.scored_topic, plan.run_id, "fork", timeout_s)
        recorded = cls(plan, tail, unplanned={} if following else None)
        recorded.read_samples(plan.steps)
        return recorded

    def extend(self, steps: Sequence[LedgerStep]) -> None:
        """Plan the run's newly recorded ``steps`` too and read their samples from where
        the last read ended."""
        self.plan = self.plan.extended(steps)
        self.read_samples(steps)

    def read_samples(self, steps: Sequence[LedgerStep]) -> None:
        plan = self.plan
        needed = plan.ids_of(steps)
        unplanned = self.unplanned if self.unplanned is not None else {}
        for i in needed & unplanned.keys():
            self.samples.setdefault(i, unplanned.pop(i))
        for sample in self.tail.read_new():
            if sample.trajectory_id in needed:
                self.samples.setdefault(sample.trajectory_id, sample)
            elif self.unplanned is not None and sample.trajectory_id not in self.samples:
                self.unplanned.setdefault(sample.trajectory_id, sample)
        lost = needed - self.samples.keys()
        if plan.partial and needed and not needed & self.samples.keys():
            raise ForkError(
                f"{plan.scored_topic} holds none of the {len(needed)} samples the steps of run "
                f"{plan.run_id!r} trained"
            )
        if lost and plan.partial:
            log.info(
                "%d of the %d recorded samples are not on %s",
                len(lost),
                len(needed),
                plan.scored_topic,
            )
        elif lost:
            numbers = [
                s.step for s in steps if any(i in lost for b in plan.micro_batches(s) for i in b)
            ]
            raise ForkError(
                f"{len(lost)} samples of run {plan.run_id!r} that steps {numbers[:10]} trained "
                f"are not on {plan.scored_topic} (its retention removed them?)"
            )
        kept = len(needed) - len(lost)
        log.info("read %d samples of %d steps of run %s", kept, len(steps), plan.run_id)

    def composition(self, step: int) -> tuple[list[list[Trajectory]], set[str]] | None:
        """Step ``step``'s micro-batches and relaxed sample ids; None past the plan."""
        index = step - self.plan.from_step - 1
        if not 0 <= index < len(self.plan.steps):
            return None
        entry = self.plan.steps[index]
        batches = [
            [self.samples[i] for i in batch if i in self.samples]
            for batch in self.plan.micro_batches(entry)
        ]
        return batches, set(entry.relaxed_ids)

    def flush_dead_letters(self) -> None:
        return None

    def route_stale(self, groups: list[StaleGroup]) -> None:
        if groups:
            raise RuntimeError("a fork sets nothing aside: it trains the recorded steps only")

    def commit(self, offsets: Mapping[TopicPartition, int]) -> bool:
        return True

    def lag(self, trained: Mapping[TopicPartition, int]) -> dict[int, int]:
        return {}

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class LedgerFollowing:
    """Follow a run that is still training: at the end of the plan, look at its ledger
    (``path``) every ``poll_s`` for more steps; give up once it has not grown for
    ``idle_s`` (the run ended, or stopped)."""

    path: Path
    idle_s: float = 120.0
    poll_s: float = 1.0


class ForkTrainer(Trainer):
    """The trainer, fed the recorded steps of another run (see the module doc)."""

    def __init__(
        self,
        shared: SharedConfig,
        trainer: TrainerConfig,
        plan: ForkPlan,
        read_timeout_s: float = 60.0,
        following: LedgerFollowing | None = None,
    ) -> None:
        if shared.run_id == plan.run_id:
            raise ForkError("a fork needs a run id of its own")
        super().__init__(shared, trainer)
        self.plan = plan
        self.read_timeout_s = read_timeout_s
        self.following = following
        self.empty_micro_batches_ok = plan.partial

    def _restore(self) -> None:
        """The fork's own last checkpoint, or the recorded run's it starts from; the
        learning rate is the fork's either way (a checkpoint carries the run's)."""
        super()._restore()
        if self.restored is not None:
            self.engine.set_peak_lr(self.config.engine.lr)

    def _connect(self) -> None:
        """The recorded steps and the publisher of the fork's own lineage; no presence,
        no topics created, no consumer group joined."""
        following = self.following is not None
        self.source = RecordedSteps.read(self.kafka, self.plan, self.read_timeout_s, following)
        self._start_publisher()

    def _settle_restored(self) -> None:
        """The ledger lines the last checkpoint has and the ledger lacks. Its stale groups
        are not routed: a checkpoint adopted from the recorded run holds that run's, which
        it routed itself, and a fork sets none aside."""
        state = self.restored
        if state is not None and self.ledger is not None:
            self.ledger.append(state.ledger, state.stale, state.refused)
        self.restored = None

    def _gather(self, count: int) -> Gathered | None:
        """The recorded composition of the next step; None past the plan's last (when
        following: once the run's ledger has stopped growing)."""
        assert isinstance(self.source, RecordedSteps)
        found = self.source.composition(self.step + 1)
        if found is None and self.following is not None and self._wait_for_recorded_steps():
            found = self.source.composition(self.step + 1)
        if found is None:
            return None
        batches, relaxed = found
        if len(batches) != count:
            raise ForkError(self.plan.accumulation_mismatch(self.step + 1, len(batches), count))
        return batches, {}, [], relaxed, set(), []

    def _wait_for_recorded_steps(self) -> bool:
        """Wait until the followed run's ledger records steps past the plan, and plan
        them; False when it has not grown for ``idle_s`` or the fork is stopped."""
        assert isinstance(self.source, RecordedSteps) and self.following is not None
        following = self.following
        deadline = time.monotonic() + following.idle_s
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            planned = self.source.plan.to_step
            steps = [s for s in TrainingLedger.read_steps(following.path) if s.step > planned]
            if steps:
                self.source.extend(steps)
                self.plan = self.source.plan
                return True
            self.stop_event.wait(following.poll_s)
        log.info(
            "run %s's ledger has not grown past step %d for %.0fs: the fork ends there",
            self.plan.run_id,
            self.source.plan.to_step,
            following.idle_s,
        )
        return False
