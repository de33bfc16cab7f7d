"""The rollout worker: prompts in, version-tagged GRPO groups out to Kafka.

One asyncio loop runs everything that is not model compute (the engine's own thread or a
remote server does that). ``RolloutWorker`` composes four parts, each in its own module:

1. **Admission** (``producers.rollout.admission``): whether a new group may start now (a version
   held, room in flight and unacknowledged, the staleness window, the trainer's credit).
2. **Versions** (``producers.rollout.versions``): the weights the engine serves; a new version
   (``on_new_version`` / thread-safe ``submit_version``) is loaded between engine calls,
   by ``version_policy`` (``finish``, ``interrupt``, ``abort``).
3. **Generation** (``producers.rollout.generation``): a group's G samples, or an environment's G
   episodes, each sample a list of segments ``(version, tokens)``.
4. **Publishing** (``producers.rollout.publishing``): records built and validated, produced by
   ``GroupPublisher``; a group counts once Kafka acknowledged all G records.

The worker itself starts groups while admission allows, runs each to its publication,
and stops. Failures: an unreachable engine is retried forever with backoff and a clear
log line (the group is regenerated); an unreachable broker is ridden out by the
idempotent producer (admission pauses once ``max_undelivered_groups`` wait); an
unreachable weight store pauses admission once the announced versions run ahead. A
malformed engine answer, an invalid record or a delivery error stops the worker with that
error. ``request_stop`` (SIGINT/SIGTERM) stops admission and, by ``rollout.stop_policy``,
aborts generation in flight (``abort``: those groups are dropped, never published, but
for the episodes a gateway's agents closed: ``_publish_agents_group``) or
lets it finish and publish (``finish``, up to ``stop_finish_timeout_s``); then it waits
for acknowledgements of what was published and returns. ``producers.app.run_producer``
writes which groups went which way as the ledger's ``stopped`` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

from producers.config import RolloutConfig
from producers.engine.backends import Backend
from producers.engine.client import EngineUnavailable
from producers.rollout.admission import Admission, TrainerSignals
from producers.rollout.curriculum import Curriculum
from producers.rollout.desk import Desk, GroupOutcome
from producers.rollout.episodes import EpisodeRunner
from producers.rollout.generation import GroupGenerator, now_ms
from producers.rollout.group_publisher import GroupPublisher
from producers.rollout.metrics import Progress
from producers.rollout.peers import Peers
from producers.rollout.publishing import Outbox, ProducerIdentity, RecordBuilder
from producers.rollout.versions import EngineVersions, Stopped, StopSignals
from producers.tasks.base import Prompt, Task
from schemas.trajectory import Trajectory

logger = logging.getLogger(__name__)

STOPPED_GROUP = "gateway_stopped_incomplete_group"
"""The dead-letter reason of closed gateway episodes whose group the stop cut short."""


@dataclass
class WorkerReport:
    groups_delivered: int = 0
    trajectories_delivered: int = 0
    groups_dropped: int = 0
    tokens: int = 0
    interrupted_samples: int = 0
    versions_applied: list[int] = field(default_factory=list)
    seconds: float = 0.0
    stop_requested: bool = False
    inflight_at_stop: list[str] = field(default_factory=list)  # group ids


@dataclass(frozen=True)
class WorkerLinks:
    """What a worker works with besides its engine and its topic, each optional:
    ``trainer`` is what it hears of its trainer (announcements, consumed version; none: a
    bare engine), ``peers`` the other policies its episodes call, ``curriculum`` picks
    prompts, ``gateway`` (``rollstream gateway``) hands each group to agents over HTTP
    instead of generating it here."""

    trainer: TrainerSignals | None = None
    peers: Peers | None = None
    curriculum: Curriculum | None = None
    gateway: Desk | None = None


class RolloutWorker:
    """Generates and publishes the groups of ``task`` with ``backend``'s engine.

    ``outbox`` holds the publishers (its own policy's and one per peer in ``links.peers``),
    ``producer`` names the records, ``links`` are the trainer, peers, curriculum and
    gateway it works with, ``vocab_size`` bounds an environment's observations."""

    def __init__(
        self,
        config: RolloutConfig,
        backend: Backend,
        task: Task,
        outbox: Outbox,
        producer: ProducerIdentity,
        *,
        links: WorkerLinks | None = None,
        vocab_size: int | None = None,
    ) -> None:
        links = links or WorkerLinks()
        self.config = config
        self.gateway = links.gateway
        self.task = task
        self.outbox = outbox
        self.peers = links.peers or Peers()
        missing = sorted(set(self.peers.engines) - set(outbox.peer_publishers))
        if missing:
            raise ValueError(f"peer policies without a publisher: {', '.join(missing)}")
        self.trainer = links.trainer or TrainerSignals()
        self.curriculum = links.curriculum
        self.metrics = outbox.metrics
        self.rng = random.Random(config.seed)
        self.report = WorkerReport()
        self._stop = StopSignals()
        self.versions = EngineVersions(
            backend,
            config.version_policy,
            self.metrics,
            self._stop,
            initial_version=config.initial_version,
            wait_for_first_version=self.trainer.wait_for_first_version,
        )
        self.generator = GroupGenerator(
            self.versions, task, config, self.metrics, vocab_size=vocab_size
        )
        self.records = RecordBuilder(producer, task, self.metrics, peers=self.peers)
        self.admission = Admission(
            config, self.versions, outbox, self.metrics, trainer=self.trainer, peers=self.peers
        )
        self._stop_deadline: float | None = None
        # group id of each admitted group task, by task name, until the loop reaps it
        self._inflight: dict[str, str] = {}
        self._failure: BaseException | None = None
        self._stop_abort: asyncio.Future | None = None

    # --- the parts, as callers know them -------------------------------------------------

    @property
    def backend(self) -> Backend:
        return self.versions.backend

    @property
    def publisher(self) -> GroupPublisher:
        return self.outbox.publisher

    @property
    def version(self) -> int:
        """The version the engine serves."""
        return self.versions.version

    @property
    def episodes(self) -> EpisodeRunner | None:
        return self.generator.episodes

    # --- control from outside ----------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.requested.is_set()

    @property
    def inflight_groups(self) -> frozenset[str]:
        """Ids of the groups being generated or published now."""
        return frozenset(self._inflight.values())

    def request_stop(self) -> None:
        """Stop starting groups; abort generation in flight or let it finish, as
        ``stop_policy`` says (safe from the loop only; from other threads or signal
        handlers use ``request_stop_threadsafe``)."""
        if self._stop.requested.is_set():
            return
        self.report.stop_requested = True
        self.report.inflight_at_stop = sorted(self._inflight.values())
        self._stop.requested.set()
        if self.gateway is not None:
            self.gateway.stopping = True
        self.versions.open_gate()  # wake anything waiting for a version change
        if self.config.stop_policy == "finish":
            logger.info(
                "stopping: no new groups; finishing %d in flight (up to %.0fs)",
                len(self._inflight),
                self.config.stop_finish_timeout_s,
            )
            self._stop_deadline = time.monotonic() + self.config.stop_finish_timeout_s
        else:
            logger.info("stopping: no new groups; aborting generation in flight")
            self.cancel_inflight()

    def cancel_inflight(self) -> None:
        """Abandon the groups in flight: their engine requests are aborted and they are
        never published."""
        if self._stop.cancelled.is_set():
            return
        self._stop.cancelled.set()
        self.versions.open_gate()
        self._stop_abort = self.versions.abort_inflight()

    def request_stop_threadsafe(self) -> None:
        if self.versions.loop is not None:
            self.versions.loop.call_soon_threadsafe(self.request_stop)

    def submit_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Offer new weights from any thread (e.g. a ``WeightFollower`` callback)."""
        self.versions.submit(version, state_dict)

    async def on_new_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Offer new weights from the worker's loop; returns once they serve (or were
        superseded by a newer offer)."""
        self.versions.offer(version, state_dict)
        while (
            self.versions.version < version
            and not self._stop.requested.is_set()
            and self._failure is None
        ):
            await asyncio.sleep(0.005)

    # --- main loop ---------------------------------------------------------------------

    async def run(
        self, groups: int | None = None, *, progress: Progress | None = None
    ) -> WorkerReport:
        """Deliver ``groups`` groups (``None``: until stopped); returns a report."""
        self.versions.loop = asyncio.get_running_loop()
        started_at = time.monotonic()
        await self.versions.adopt_engine_version()
        helpers = [
            asyncio.create_task(self._guarded(self.versions.run()), name="versions"),
            asyncio.create_task(
                self._guarded(self.outbox.run(progress, self.config.mark_interval_s)),
                name="poll",
            ),
            *(
                asyncio.create_task(peer.run_versions(), name=f"versions-{name}")
                for name, peer in self.peers.engines.items()
            ),
        ]
        tasks: set[asyncio.Task] = set()
        started = 0
        try:
            while not self._stop.requested.is_set() and (groups is None or started < groups):
                while len(tasks) >= self.config.max_inflight_groups:
                    await self._reap(tasks)
                if not await self._admit(tasks):
                    break
                started += 1
                self.admission.started()
                # in flight from here until reaped, not only while it awaits the engine: a
                # stop that comes before the task runs or before the loop saw it end must
                # still account for it
                name = f"group-{started}"
                self._inflight[name] = uuid.uuid4().hex
                tasks.add(asyncio.create_task(self._group_task(name), name=name))
            while tasks:
                if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                    logger.warning("groups in flight not finished in time: aborting them")
                    self._stop_deadline = None
                    self.cancel_inflight()
                await self._reap(tasks)
            await self.outbox.drain(self._stop.requested)
        except BaseException:
            self._stop.requested.set()
            self.versions.open_gate()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._inflight.clear()
            raise
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self._settle_report(started_at)
            if progress is not None:
                progress.close()
        if self._failure is not None:
            raise self._failure
        return self.report

    def _settle_report(self, started_at: float) -> None:
        """The report's counts, gathered from the parts that kept them."""
        self.report.seconds = time.monotonic() - started_at
        self.report.groups_delivered = self.publisher.delivered_groups
        self.report.trajectories_delivered = int(self.metrics.get("trajectories_total"))
        self.report.tokens = self.generator.tokens
        self.report.interrupted_samples = self.generator.interrupted
        self.report.versions_applied = list(self.versions.applied)

    async def _guarded(self, work: Awaitable[None]) -> None:
        """A helper of the loop whose failure stops the worker with its error."""
        try:
            await work
        except Exception as exc:
            self._fail(exc)

    async def _reap(self, tasks: set[asyncio.Task]) -> None:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
        for task in done:
            tasks.discard(task)
            self._inflight.pop(task.get_name(), None)
            task.result()  # a group's fatal error stops the worker
        if self._failure is not None:
            raise self._failure

    async def _admit(self, tasks: set[asyncio.Task]) -> bool:
        """Wait until a new group may start; False when stopping."""
        while not self._stop.requested.is_set():
            if self._failure is not None:
                raise self._failure
            if self.admission.admit():
                return True
            if tasks:
                await self._reap(tasks)
            else:
                await asyncio.sleep(0.05)
        return False

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.request_stop()
        self.cancel_inflight()

    # --- one group -----------------------------------------------------------------------

    async def _group_task(self, name: str) -> None:
        """One admitted group (its id in ``_inflight[name]``). A retry after an engine
        outage generates it again under a new id."""
        if self._stop.cancelled.is_set():  # aborted before it began
            self.report.groups_dropped += 1
            return
        backoff = 1.0
        prompt = self._prompt()  # kept across retries: a prompt is not skipped for an outage
        while True:
            try:
                await self._run_group(prompt, self._inflight[name])
                return
            except Stopped:
                self.report.groups_dropped += 1
                return
            except EngineUnavailable as exc:
                self.metrics.engine_errors.inc()
                logger.warning("engine unavailable (%s); retrying the group in %.0fs", exc, backoff)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.cancelled.wait(), backoff)
                backoff = min(backoff * 2, 30.0)
                if self._stop.cancelled.is_set():
                    self.report.groups_dropped += 1
                    return
                self._inflight[name] = uuid.uuid4().hex

    def _prompt(self) -> Prompt:
        if self.curriculum is not None:
            return self.curriculum.choose(lambda: self.task.sample(self.rng))
        return self.task.sample(self.rng)

    async def _run_group(self, prompt: Prompt, group_id: str) -> None:
        """Generate one group, build its records and publish them (and its peer groups)."""
        created_ms = now_ms()
        size = self.config.group_size
        self.metrics.inflight_groups.inc()
        began = time.perf_counter()
        try:
            if self.gateway is not None:
                outcome = await self.gateway.play(prompt, group_id, size, self._stop)
            elif self.generator.episodes is not None:
                episodes = await self.generator.episodes_of(prompt, group_id)
            else:
                samples = await self.generator.group(prompt, group_id)
        finally:
            self.metrics.inflight_groups.dec()
        generated = time.perf_counter() - began
        peer_groups: list[tuple[str, str, list[Trajectory]]] = []
        if self.gateway is not None:
            await self._publish_agents_group(prompt, group_id, outcome, created_ms)
            self.metrics.generate_seconds.observe(generated)
            return
        if self.generator.episodes is not None:
            trajectories = [
                self.records.episode_trajectory(prompt, group_id, i, size, episode, created_ms)
                for i, episode in enumerate(episodes)
            ]
            peer_groups = self.records.peer_groups(episodes, group_id, created_ms)
        else:
            trajectories = await self.records.group_trajectories(
                prompt, group_id, samples, created_ms
            )
        began = time.perf_counter()
        await self.outbox.publish(group_id, trajectories, peer_groups)
        self.metrics.publish_seconds.observe(time.perf_counter() - began)
        self.metrics.generate_seconds.observe(generated)

    async def _publish_agents_group(
        self, prompt: Prompt, group_id: str, outcome: GroupOutcome, created_ms: int
    ) -> None:
        """The records of the episodes the gateway's agents closed, published as the group
        (its size: how many there are). A group the stop cut short with fewer than
        ``stop_min_episodes`` closed goes to the dead-letter topic instead: its agents
        were told their episodes were accepted, so they are never dropped unsaid."""
        assert self.gateway is not None
        if outcome.abandoned:
            self.publisher.ledger.abandoned(group_id, outcome.abandoned)
        if not outcome.records:
            self.report.groups_dropped += 1
            return
        provenance = getattr(self.task, "provenance", None)  # which row, for a resume
        row = provenance(prompt) if provenance is not None else {}
        for _, result in outcome.records:
            result.details.update(row)
        trajectories = [
            self.records.episode_trajectory(
                part_prompt, group_id, i, len(outcome.records), result, created_ms
            )
            for i, (part_prompt, result) in enumerate(outcome.records)
        ]
        gateway = self.config.gateway
        if outcome.stopped and len(outcome.closed) < gateway.stop_min_episodes:
            detail = (
                f"the producer stopped with {len(outcome.closed)} of the group's "
                f"{self.config.group_size} episodes closed (stop_min_episodes "
                f"{gateway.stop_min_episodes}); never produced to {self.publisher.topic}"
            )
            self.gateway.settle(outcome, "dead_lettering")
            self.publisher.dead_letter(
                group_id, trajectories, gateway.dead_letter_topic, STOPPED_GROUP, detail
            )
            self.report.groups_dropped += 1
            return
        began = time.perf_counter()
        await self.outbox.publish(group_id, trajectories)
        self.gateway.settle(outcome, "publishing")
        self.metrics.publish_seconds.observe(time.perf_counter() - began)
