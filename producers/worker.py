"""The rollout worker: prompts in, version-tagged GRPO groups out to Kafka.

One asyncio loop runs everything that is not model compute (the engine's own thread or
a remote server does that):

1. **Admission.** A new group starts only when the worker holds a version (when
   following weights, the first one must arrive), fewer than ``max_inflight_groups`` are
   generating, fewer than ``max_undelivered_groups`` await Kafka's acknowledgement
   (bounded memory while the broker is away), the engine's version is at most
   ``staleness_window`` versions behind the newest announced one (else the weight store
   is lagging or down: wait for the follower), the worker has credit (below), and the
   engine is at most ``staleness_window`` versions ahead of the trainer's consumed
   version when a ``consumed_version`` hook gives one. Each pause and its reason is
   logged once.

   **Credit** (backpressure from the trainer's *trained* version, no setting needed).
   The trainer announces, with every version, its step count (= the version) and how
   many groups a step takes (``VersionAnnouncement.groups_per_step``; overridden by
   ``groups_per_version`` when set) and its staleness window (the worker uses the
   smaller of that and its own ``staleness_window``). Several producers share one
   trainer's pace: the trainer announces how many producers' groups it trained over its
   last window + 1 steps (``VersionAnnouncement.producers``), and each producer's share
   of a step is ``groups_per_step / producers`` groups (a producer that just joined is
   counted once its first groups are trained). ``lead`` is how many trainer steps of data
   this worker started beyond the trainer's trained version: each group started adds
   1 / share (at the share in force when it started), each version the trainer announces
   takes 1 away, never below 0. A new group starts only while lead + (trained version -
   engine version) < window + 1: the group then reaches the trainer at most ``window``
   versions after the version that generates it. A stopped trainer announces nothing,
   so generation pauses once the lead reaches the window; it resumes with the next
   announcement. Without announcements (not following weights) credit counts the
   versions the engine loads.
2. **Generation.** The G samples of a group go to the engine as one batch request, each
   with its own rid. A sample's response is a list of segments ``(version, tokens)``.
3. **Version changes** (``on_new_version`` / thread-safe ``submit_version``): the worker
   closes the gate for new engine calls, then per ``version_policy``:
   ``finish``: waits for calls in flight to finish on the old weights;
   ``interrupt``: aborts them (keeping their tokens), loads the new weights, and
   continues each cut sample from prompt + partial response on the new weights: a
   partial rollout with two (or more) segments;
   ``abort``: aborts them, discards their tokens and regenerates them from scratch.
   Weights change only while no engine call is in flight, so every token's version is
   known exactly; the engine's own ``weight_version`` is used when it reports an integer.
4. **Publishing.** Rewards are computed, records built and validated
   (``schemas.validation``), the group is produced by ``GroupPublisher`` and counts once
   Kafka acknowledged all G records (the ledger says so durably).

Failures: an unreachable engine is retried forever with backoff and a clear log line
(the group is regenerated); an unreachable broker is ridden out by the idempotent
producer (admission pauses once ``max_undelivered_groups`` wait); an unreachable weight
store pauses admission once the announced versions run ahead. A malformed engine
answer, an invalid record or a delivery error stops the worker with that error.
``request_stop`` (SIGINT/SIGTERM) stops admission and, by ``rollout.stop_policy``,
aborts generation in flight (``abort``: those groups are dropped, never published) or lets
it finish and publish (``finish``, up to ``stop_finish_timeout_s``); then it waits for
acknowledgements of what was published and returns. ``run_producer`` writes which groups
went which way as the ledger's ``stopped`` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from core.config import RoleConfig, SharedConfig
from producers.backends import Backend, LocalBackend
from producers.client import EngineError, EngineUnavailable, GenerateOutput
from producers.config import EngineConfig, ProducersConfig, RolloutConfig
from producers.credit import AdmissionCredit
from producers.curriculum import Curriculum, PromptStatsReader, PromptStatsView
from producers.environments import EpisodeLimits, is_environment
from producers.episodes import EpisodeResult, EpisodeRunner, GenerateTurn
from producers.group_publisher import GroupPublisher
from producers.ledger import Ledger, StopRecord
from producers.metrics import ProducerMetrics, Progress
from producers.peers import PeerEngine, Peers, PeerSample
from producers.tasks import Prompt, Task
from schemas.control import VersionAnnouncement
from schemas.trajectory import NO_VERSION, Trajectory
from schemas.validation import ValidationLimits, validate

logger = logging.getLogger(__name__)


class Stopped(Exception):
    """The worker is stopping: the group in hand is dropped."""


class InvalidTrajectory(RuntimeError):
    """A record the worker built failed validation: a bug or a broken engine."""


@dataclass
class Sample:
    """One finished response with its per-version segments."""

    response_ids: list[int]
    logprobs: list[float]
    segments: list[list[int]]  # [version, length] pairs, versions non-decreasing
    finish_type: str
    finished_at_ms: int
    interruptions: int = 0


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


def _now_ms() -> int:
    return int(time.time() * 1000)


class RolloutWorker:
    def __init__(
        self,
        *,
        config: RolloutConfig,
        backend: Backend,
        task: Task,
        publisher: GroupPublisher,
        run_id: str,
        producer_id: str,
        region: str,
        metrics: ProducerMetrics | None = None,
        consumed_version: Callable[[], int | None] | None = None,
        announced_version: Callable[[], int | None] | None = None,
        announcement: Callable[[], VersionAnnouncement | None] | None = None,
        wait_for_first_version: bool = False,
        mark: Callable[[], Mapping[int, int]] | None = None,
        limits: ValidationLimits | None = None,
        curriculum: Curriculum | None = None,
        vocab_size: int | None = None,
        policy: str = "",
        peers: Peers | None = None,
        peer_publishers: Mapping[str, GroupPublisher] | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.peers = peers or Peers()
        self.peer_publishers = dict(peer_publishers or {})
        missing = sorted(set(self.peers.engines) - set(self.peer_publishers))
        if missing:
            raise ValueError(f"peer policies without a publisher: {', '.join(missing)}")
        self.curriculum = curriculum
        self.backend = backend
        self.task = task
        self.publisher = publisher
        self.run_id = run_id
        self.producer_id = producer_id
        self.region = region
        self.metrics = metrics or publisher.metrics
        self.consumed_version = consumed_version
        self.announced_version = announced_version
        self.announcement = announcement
        self.limits = limits or ValidationLimits()
        self.episodes: EpisodeRunner | None = None
        if is_environment(task):
            env_limits: EpisodeLimits = task.limits  # type: ignore[attr-defined]
            env_limits = dataclasses.replace(env_limits, **config.episode.overrides())
            self.episodes = EpisodeRunner(task, env_limits, vocab_size)  # type: ignore[arg-type]
        self._mark = mark
        self.rng = random.Random(config.seed)
        # NO_VERSION until the first version is loaded, when the engine's own weights
        # are not a published version (weights come from the WeightFollower).
        self.wait_for_first_version = wait_for_first_version
        self.version = NO_VERSION if wait_for_first_version else config.initial_version
        self.latest_version = self.version
        self.report = WorkerReport()
        try:  # so that submit_version works before run() (e.g. a follower's first sync)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()  # no new groups
        self._cancel = asyncio.Event()  # abandon the groups in flight too
        self._stop_deadline: float | None = None
        self._inflight_groups: set[str] = set()
        self._version_ready = asyncio.Event()
        self._pending_version: tuple[int, Mapping[str, Any]] | None = None
        # The weights the engine was last given: reloaded if it restarts and forgets them.
        self._loaded: tuple[int, Mapping[str, Any]] | None = None
        self._inflight_calls = 0
        self._inflight_rids: set[str] = set()
        self._swaps = 0  # incremented when a version change starts
        self._failure: BaseException | None = None
        self._stop_abort: asyncio.Future | None = None
        self._engine_version_warned = False
        self._groups_started = 0
        self.credit = AdmissionCredit(config.groups_per_version)
        self.metrics.version.set(self.version)
        self.metrics.latest_version.set(self.version)

    # --- control from outside ----------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def inflight_groups(self) -> frozenset[str]:
        """Ids of the groups being generated or published now."""
        return frozenset(self._inflight_groups)

    def request_stop(self) -> None:
        """Stop starting groups; abort generation in flight or let it finish, as
        ``stop_policy`` says (safe from the loop only; from other threads or signal
        handlers use ``request_stop_threadsafe``)."""
        if self._stop.is_set():
            return
        self.report.stop_requested = True
        self.report.inflight_at_stop = sorted(self._inflight_groups)
        self._stop.set()
        self._gate.set()  # wake anything waiting for a version change
        if self.config.stop_policy == "finish":
            logger.info(
                "stopping: no new groups; finishing %d in flight (up to %.0fs)",
                len(self._inflight_groups),
                self.config.stop_finish_timeout_s,
            )
            self._stop_deadline = time.monotonic() + self.config.stop_finish_timeout_s
        else:
            logger.info("stopping: no new groups; aborting generation in flight")
            self.cancel_inflight()

    def cancel_inflight(self) -> None:
        """Abandon the groups in flight: their engine requests are aborted and they are
        never published."""
        if self._cancel.is_set():
            return
        self._cancel.set()
        self._gate.set()
        if self._inflight_rids:
            self._stop_abort = asyncio.ensure_future(self._abort(list(self._inflight_rids)))

    def request_stop_threadsafe(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.request_stop)

    def submit_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Offer new weights from any thread (e.g. a ``WeightFollower`` callback)."""
        if self._loop is None:
            raise RuntimeError("the worker is not running")
        self._loop.call_soon_threadsafe(self._offer_version, version, state_dict)

    async def on_new_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Offer new weights from the worker's loop; returns once they serve (or were
        superseded by a newer offer)."""
        self._offer_version(version, state_dict)
        while self.version < version and not self._stop.is_set() and self._failure is None:
            await asyncio.sleep(0.005)

    def _offer_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        if version <= max(self.version, self._pending_version[0] if self._pending_version else -1):
            logger.info("version %d ignored: not newer than the current one", version)
            return
        self._pending_version = (version, state_dict)
        self.latest_version = max(self.latest_version, version)
        self.metrics.latest_version.set(self.latest_version)
        self.metrics.version_lag.set(self.latest_version - self.version)
        self._version_ready.set()

    # --- main loop ---------------------------------------------------------------------

    async def run(
        self, groups: int | None = None, *, progress: Progress | None = None
    ) -> WorkerReport:
        """Deliver ``groups`` groups (``None``: until stopped); returns a report."""
        self._loop = asyncio.get_running_loop()
        started_at = time.monotonic()
        await self._adopt_engine_version()
        helpers = [
            asyncio.create_task(self._version_loop(), name="versions"),
            asyncio.create_task(self._poll_loop(progress), name="poll"),
            *(
                asyncio.create_task(peer.run_versions(), name=f"versions-{name}")
                for name, peer in self.peers.engines.items()
            ),
        ]
        tasks: set[asyncio.Task] = set()
        started = 0
        try:
            while not self._stop.is_set() and (groups is None or started < groups):
                while len(tasks) >= self.config.max_inflight_groups:
                    await self._reap(tasks)
                if not await self._admit(tasks):
                    break
                started += 1
                self._groups_started += 1
                self.credit.started()
                for peer in self.peers.engines.values():
                    peer.started()
                tasks.add(asyncio.create_task(self._group_task(), name=f"group-{started}"))
            while tasks:
                if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                    logger.warning("groups in flight not finished in time: aborting them")
                    self._stop_deadline = None
                    self.cancel_inflight()
                await self._reap(tasks)
            await self._drain()
        except BaseException:
            self._stop.set()
            self._gate.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self.report.seconds = time.monotonic() - started_at
            self.report.groups_delivered = self.publisher.delivered_groups
            self.report.trajectories_delivered = int(self.metrics.get("trajectories_total"))
            if progress is not None:
                progress.close()
        if self._failure is not None:
            raise self._failure
        return self.report

    async def _reap(self, tasks: set[asyncio.Task]) -> None:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
        for task in done:
            tasks.discard(task)
            task.result()  # a group's fatal error stops the worker
        if self._failure is not None:
            raise self._failure

    async def _admit(self, tasks: set[asyncio.Task]) -> bool:
        """Wait until a new group may start; False when stopping."""
        reason = None
        while not self._stop.is_set():
            if self._failure is not None:
                raise self._failure
            why = self._pause_reason()
            if why is None:
                self.metrics.admission_paused.set(0)
                if reason is not None:
                    logger.info("admission resumed")
                return True
            self.metrics.admission_paused.set(1)
            if why != reason:
                reason = why
                logger.info("admission paused: %s", why)
            if tasks:
                await self._reap(tasks)
            else:
                await asyncio.sleep(0.05)
        return False

    def _pause_reason(self) -> str | None:
        """Why no new group may start now, or None."""
        trainer = self.announcement() if self.announcement is not None else None
        window = self.config.staleness_window
        if trainer is not None and trainer.max_staleness is not None:
            window = min(window, trainer.max_staleness)
        if self.version == NO_VERSION:
            return "waiting for the first policy version from the weight follower"
        announced = self.announced_version() if self.announced_version is not None else None
        if trainer is not None:
            announced = max(announced or 0, trainer.version)
        if announced is not None:
            if announced > self.latest_version:
                self.latest_version = announced
                self.metrics.latest_version.set(announced)
            self.metrics.version_lag.set(self.latest_version - self.version)
            if announced - self.version > window:
                return (
                    f"serving v{self.version} but v{announced} is announced, more than the "
                    f"staleness window ({window}) behind: waiting for the weight follower "
                    "(is the weight store reachable?)"
                )
        if (why := self._credit_pause(trainer, window)) is not None:
            return why
        consumed = self.consumed_version() if self.consumed_version is not None else None
        if consumed is not None:
            ahead = self.version - consumed
            self.metrics.consumed_lag.set(ahead)
            if ahead > window:
                return (
                    f"v{self.version} is {ahead} versions ahead of the trainer's consumed "
                    f"version {consumed} (staleness window {window})"
                )
        if self.publisher.undelivered_groups >= self.config.max_undelivered_groups:
            return f"{self.publisher.undelivered_groups} groups await Kafka acknowledgement"
        for name, publisher in self.peer_publishers.items():
            if publisher.undelivered_groups >= self.config.max_undelivered_groups:
                return (
                    f"{publisher.undelivered_groups} groups of peer policy {name!r} await "
                    "Kafka acknowledgement"
                )
        for peer in self.peers.engines.values():  # each peer policy's own admission
            if (why := peer.pause_reason()) is not None:
                return why
        return None

    def _credit_pause(self, trainer: VersionAnnouncement | None, window: int) -> str | None:
        """The credit rule of the module doc: why the credit is used up, or None."""
        why = self.credit.pause(trainer, window, self.version)
        self.metrics.lead.set(self.credit.lead)
        return why

    async def _poll_loop(self, progress: Progress | None) -> None:
        last_mark = time.monotonic()
        last_progress = 0.0
        while True:
            try:
                for publisher in (self.publisher, *self.peer_publishers.values()):
                    publisher.poll(0)
            except Exception as exc:  # a delivery error: stop the worker with it
                self._fail(exc)
                return
            now = time.monotonic()
            if progress is not None and now - last_progress >= 0.25:
                last_progress = now
                progress.update()
            if self._mark is not None and now - last_mark >= self.config.mark_interval_s:
                last_mark = now
                try:
                    offsets = await asyncio.to_thread(self._mark)
                except Exception as exc:  # a missed mark only widens a later recovery scan
                    logger.warning("could not record partition end offsets: %s", exc)
                else:
                    self.publisher.ledger.mark(offsets)
                await self._mark_peer_ledgers()
            await asyncio.sleep(0.01)

    async def _mark_peer_ledgers(self) -> None:
        """Record each peer topic's end offsets in its ledger (bounds its recovery scan)."""
        from core.topic_reader import end_offsets

        for publisher in self.peer_publishers.values():
            try:
                offsets = await asyncio.to_thread(
                    end_offsets, publisher.client_config, publisher.topic
                )
            except Exception as exc:
                logger.warning("could not record end offsets of %s: %s", publisher.topic, exc)
            else:
                publisher.ledger.mark(offsets)

    async def _drain(self, stopping_limit_s: float = 30.0) -> None:
        """Wait until Kafka acknowledged every published group. When stopping on a signal,
        give up after ``stopping_limit_s``: what is left stays ``pending`` in the ledger
        and the next start's recovery settles it."""
        began = last_log = time.monotonic()
        publishers = (self.publisher, *self.peer_publishers.values())
        while any(p.undelivered_groups for p in publishers):
            for publisher in publishers:
                publisher.poll(0)
            now = time.monotonic()
            if self._stop.is_set() and now - began > stopping_limit_s:
                logger.warning(
                    "stopping with %d group(s) unacknowledged (left to recovery)",
                    sum(p.undelivered_groups for p in publishers),
                )
                return
            if now - last_log > 10:
                last_log = now
                logger.info(
                    "waiting for Kafka to acknowledge %d group(s)",
                    sum(p.undelivered_groups for p in publishers),
                )
            await asyncio.sleep(0.01)
        for publisher in publishers:
            publisher.flush(30)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.request_stop()
        self.cancel_inflight()

    # --- one group -----------------------------------------------------------------------

    async def _group_task(self) -> None:
        backoff = 1.0
        while True:
            try:
                await self._run_group()
                return
            except Stopped:
                self.report.groups_dropped += 1
                return
            except EngineUnavailable as exc:
                self.metrics.engine_errors.inc()
                logger.warning("engine unavailable (%s); retrying the group in %.0fs", exc, backoff)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._cancel.wait(), backoff)
                backoff = min(backoff * 2, 30.0)
                if self._cancel.is_set():
                    self.report.groups_dropped += 1
                    return

    async def _run_group(self) -> None:
        if self.curriculum is not None:
            prompt = self.curriculum.choose(lambda: self.task.sample(self.rng))
        else:
            prompt = self.task.sample(self.rng)
        group_id = uuid.uuid4().hex
        created_ms = _now_ms()
        size = self.config.group_size
        params = self.config.sampling.to_sglang(self.task.max_new_tokens, self.task.stop_token_ids)
        self.metrics.inflight_groups.inc()
        self._inflight_groups.add(group_id)
        began = time.perf_counter()
        try:
            if self.episodes is not None:
                episodes = await self._generate_episodes(self.episodes, prompt, group_id, size)
            else:
                samples = await self._generate_group(prompt, group_id, size, params)
        except BaseException:  # aborted, or to be generated again under a new id
            self._inflight_groups.discard(group_id)
            raise
        finally:
            self.metrics.inflight_groups.dec()
        generated = time.perf_counter() - began
        peer_groups: list[tuple[str, str, list[Trajectory]]] = []
        if self.episodes is not None:
            trajectories = [
                self._episode_trajectory(prompt, group_id, i, size, episode, created_ms)
                for i, episode in enumerate(episodes)
            ]
            peer_groups = self._peer_groups(episodes, group_id, created_ms)
        else:
            trajectories = [
                self._trajectory(prompt, group_id, i, size, sample, created_ms)
                for i, sample in enumerate(samples)
            ]
        began = time.perf_counter()
        try:
            await self.publisher.publish_async(group_id, trajectories)
            for policy, peer_group_id, records in peer_groups:
                await self.peer_publishers[policy].publish_async(peer_group_id, records)
        finally:
            self._inflight_groups.discard(group_id)
        self.metrics.publish_seconds.observe(time.perf_counter() - began)
        self.metrics.generate_seconds.observe(generated)

    def _trajectory(
        self, prompt: Prompt, group_id: str, index: int, size: int, sample: Sample, created_ms: int
    ) -> Trajectory:
        reward, details = self.task.reward(prompt, sample.response_ids)
        if sample.interruptions:
            details = {**details, "interruptions": sample.interruptions}
        return self._record(
            prompt,
            group_id,
            index,
            size,
            created_ms,
            response_ids=sample.response_ids,
            logp_infer=sample.logprobs,
            segment_versions=[v for v, _ in sample.segments],
            segment_lengths=[n for _, n in sample.segments],
            reward=float(reward),
            reward_details=details,
            finish_reason=sample.finish_type,
            finished_at_ms=max(created_ms, sample.finished_at_ms),
        )

    def _episode_trajectory(
        self,
        prompt: Prompt,
        group_id: str,
        index: int,
        size: int,
        episode: EpisodeResult,
        created_ms: int,
    ) -> Trajectory:
        details = dict(episode.details)
        if episode.interruptions:
            details["interruptions"] = episode.interruptions
        self.metrics.episodes.labels(end=episode.end.value).inc()
        self.metrics.tool_calls.inc(episode.tool_calls)
        return self._record(
            prompt,
            group_id,
            index,
            size,
            created_ms,
            **episode.trajectory_fields(self.policy),
            reward_details=details,
            finished_at_ms=max(created_ms, _now_ms()),
        )

    def _peer_groups(
        self, episodes: list[EpisodeResult], group_id: str, created_ms: int
    ) -> list[tuple[str, str, list[Trajectory]]]:
        """The records the group's episodes made of peer policies' turns: per peer
        policy, one group ``<group id>-<policy>`` of every such sample (a group of one
        has no spread to learn from and is dropped), for that policy's raw topic."""
        by_policy: dict[str, list[PeerSample]] = {name: [] for name in self.peers.engines}
        for episode in episodes:
            for sample in episode.peer_samples:
                if sample.turn.policy not in by_policy:  # the environment named no peer
                    logger.warning(
                        "dropping a peer sample of policy %r: not a peer of this producer (%s)",
                        sample.turn.policy,
                        ", ".join(sorted(by_policy)) or "none",
                    )
                    self.metrics.peer_samples_dropped.labels(policy="unknown").inc()
                    continue
                by_policy[sample.turn.policy].append(sample)
        groups = []
        for policy, samples in sorted(by_policy.items()):
            if len(samples) < 2:
                self.metrics.peer_samples_dropped.labels(policy=policy).inc(len(samples))
                self.peers[policy].refund()  # no group for its trainer: its credit comes back
                continue
            peer_group_id = f"{group_id}-{policy}"
            self.metrics.peer_samples.labels(policy=policy).inc(len(samples))
            records = [
                self._peer_record(sample, peer_group_id, i, len(samples), created_ms)
                for i, sample in enumerate(samples)
            ]
            groups.append((policy, peer_group_id, records))
        return groups

    def _peer_record(
        self, sample: PeerSample, group_id: str, index: int, size: int, created_ms: int
    ) -> Trajectory:
        turn = sample.turn
        return self._new_record(
            group_id,
            index,
            size,
            created_ms,
            policy=turn.policy,
            prompt_ids=turn.prompt_ids,
            response_ids=turn.response_ids,
            logp_infer=turn.logprobs,
            segment_versions=[turn.version],
            segment_lengths=[len(turn.response_ids)],
            reward=float(sample.reward),
            reward_details=sample.details,
            finish_reason=turn.finish_type,
            finished_at_ms=max(created_ms, turn.finished_at_ms),
        )

    def _record(
        self,
        prompt: Prompt,
        group_id: str,
        index: int,
        size: int,
        created_ms: int,
        **fields: Any,
    ) -> Trajectory:
        """A validated record of one sample of a group of this producer's policy."""
        return self._new_record(
            group_id, index, size, created_ms, policy=self.policy, prompt_ids=prompt.ids, **fields
        )

    def _new_record(
        self, group_id: str, index: int, size: int, created_ms: int, **fields: Any
    ) -> Trajectory:
        """A validated record of sample ``index`` of a group (of any policy it feeds)."""
        traj = Trajectory.create(
            run_id=self.run_id,
            trajectory_id=f"{group_id}-{index}",
            group_id=group_id,
            group_size=size,
            sample_index=index,
            producer_id=self.producer_id,
            region=self.region,
            task=self.task.name,
            created_at_ms=created_ms,
            **fields,
        )
        defects = validate(traj, self.limits)
        if defects:
            raise InvalidTrajectory(
                f"record {traj.trajectory_id} is invalid: " + "; ".join(map(str, defects))
            )
        return traj

    async def _generate_group(
        self, prompt: Prompt, group_id: str, size: int, params: dict[str, Any]
    ) -> list[Sample]:
        rids = [f"{group_id}-{i}-0" for i in range(size)]
        outputs, version, swaps = await self._call([prompt.ids] * size, [params] * size, rids)
        return list(
            await asyncio.gather(
                *(
                    self._complete(prompt.ids, params, f"{group_id}-{i}", out, version, swaps)
                    for i, out in enumerate(outputs)
                )
            )
        )

    async def _generate_episodes(
        self, runner: EpisodeRunner, prompt: Prompt, group_id: str, size: int
    ) -> list[EpisodeResult]:
        """The G episodes of a group, side by side: their turns reach the engine
        concurrently, so it batches them as it batches a single-turn group."""

        def turn_of(index: int) -> GenerateTurn:
            async def generate_turn(history: list[int], max_new_tokens: int, turn: int) -> Sample:
                params = self.config.sampling.to_sglang(
                    max_new_tokens, self.task.stop_token_ids, getattr(self.task, "stop", None)
                )
                rid = f"{group_id}-{index}-t{turn}"
                outputs, version, swaps = await self._call([history], [params], [f"{rid}-0"])
                return await self._complete(history, params, rid, outputs[0], version, swaps)

            return generate_turn

        return list(await asyncio.gather(*(runner.run(prompt, turn_of(i)) for i in range(size))))

    async def _complete(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        rid_prefix: str,
        out: GenerateOutput,
        version: int,
        swaps: int,
    ) -> Sample:
        """Follow one sample through interruptions until it finishes."""
        ids: list[int] = []
        logprobs: list[float] = []
        segments: list[list[int]] = []
        interruptions = 0
        limit = int(params["max_new_tokens"])
        while True:
            if out.output_ids:
                v = self._segment_version(out, version)
                if segments and segments[-1][0] == v:
                    segments[-1][1] += len(out.output_ids)
                else:
                    segments.append([v, len(out.output_ids)])
                ids += out.output_ids
                logprobs += out.logprobs or []
            if not out.aborted:
                return Sample(ids, logprobs, segments, out.finish_type, _now_ms(), interruptions)
            if self._cancel.is_set():
                raise Stopped
            if swaps == self._swaps:
                raise EngineError(
                    f"engine aborted request {out.rid} without a version change: "
                    f"{out.finish_reason}"
                )
            interruptions += 1
            self.report.interrupted_samples += 1
            self.metrics.interrupted.labels(self.config.version_policy).inc()
            if self.config.version_policy == "abort":
                ids, logprobs, segments = [], [], []
            remaining = limit - len(ids)
            if remaining <= 0:
                return Sample(ids, logprobs, segments, "length", _now_ms(), interruptions)
            rid = f"{rid_prefix}-{interruptions}"
            more = {**params, "max_new_tokens": remaining}
            outputs, version, swaps = await self._call([prompt_ids + ids], [more], [rid])
            out = outputs[0]

    def _segment_version(self, out: GenerateOutput, believed: int) -> int:
        """The engine's integer ``weight_version`` if it reports one, else our belief."""
        try:
            reported = int(out.weight_version) if out.weight_version is not None else None
        except ValueError:
            reported = None
        if reported is None:
            return believed
        if self._engine_forgot_weights(reported, believed):
            return reported
        if reported != believed and not self._engine_version_warned:
            self._engine_version_warned = True
            logger.warning(
                "engine reports weight_version %d, the worker believed %d: using the engine's",
                reported,
                believed,
            )
        return reported

    def _engine_forgot_weights(self, reported: int, believed: int) -> bool:
        """An engine that restarted serves its initial weights: give it ours again.

        The samples it already produced keep the version it reports (honest tags; the
        stream judges their staleness), and the reload goes through the version loop like
        any swap, so no engine call straddles it.
        """
        loaded = self._loaded
        if loaded is None or loaded[0] != believed or reported >= believed:
            return False
        if self._pending_version is None:
            logger.warning(
                "engine reports weight_version %d but was given %d (restarted?): reloading %d",
                reported,
                believed,
                believed,
            )
            self._pending_version = loaded
            self._version_ready.set()
        return True

    async def _call(
        self, prompts: list[list[int]], sampling: list[dict[str, Any]], rids: list[str]
    ) -> tuple[list[GenerateOutput], int, int]:
        """One engine call, admitted by the version gate; returns the outputs with the
        version and swap counter in force when it was issued."""
        while not self._gate.is_set():
            await self._gate.wait()
        if self._cancel.is_set():
            raise Stopped
        version, swaps = self.version, self._swaps
        self._inflight_calls += 1
        self._idle.clear()
        self._inflight_rids.update(rids)
        try:
            outputs = await self.backend.generate(prompts, sampling, rids)
        finally:
            self._inflight_calls -= 1
            self._inflight_rids.difference_update(rids)
            if self._inflight_calls == 0:
                self._idle.set()
        tokens = sum(len(o.output_ids) for o in outputs)
        self.metrics.tokens.inc(tokens)
        self.report.tokens += tokens
        return outputs, version, swaps

    # --- versions ------------------------------------------------------------------------

    async def _adopt_engine_version(self) -> None:
        if self.wait_for_first_version:
            return  # the follower's first version replaces whatever the engine holds
        info = await self.backend.model_info()
        try:
            reported = int(info.get("weight_version"))
        except (TypeError, ValueError):
            return
        if reported != self.version:
            logger.info("engine serves weight_version %d; starting from it", reported)
            self.version = self.latest_version = reported
            self.metrics.version.set(reported)
            self.metrics.latest_version.set(reported)

    async def _version_loop(self) -> None:
        while True:
            await self._version_ready.wait()
            self._version_ready.clear()
            if self._pending_version is None:
                continue
            version, state_dict = self._pending_version
            self._pending_version = None
            try:
                await self._swap(version, state_dict)
            except Exception as exc:  # the worker cannot go on without knowing its weights
                self._fail(exc)
                return

    async def _swap(self, version: int, state_dict: Mapping[str, Any]) -> None:
        policy = self.config.version_policy
        self._gate.clear()
        self._swaps += 1
        try:
            if policy != "finish" and self._inflight_rids:
                await self._abort(list(self._inflight_rids))
            await self._idle.wait()
            backoff = 1.0
            while True:
                try:
                    await self.backend.load_version(version, state_dict)
                    break
                except EngineUnavailable as exc:
                    self.metrics.engine_errors.inc()
                    logger.warning("engine unavailable while loading v%d (%s)", version, exc)
                    if self._stop.is_set():
                        return
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
            if version != self.version:
                self.report.versions_applied.append(version)
            self.version = version
            self._loaded = (version, state_dict)
            self.metrics.version.set(version)
            self.metrics.version_lag.set(self.latest_version - version)
            logger.info("now generating with version %d (policy %s)", version, policy)
        finally:
            self._gate.set()

    async def _abort(self, rids: list[str]) -> None:
        try:
            await self.backend.abort(rids)
        except EngineError as exc:  # the calls then finish on their own
            logger.warning("could not abort %d request(s): %s", len(rids), exc)


# --- assembling a worker from the configuration ------------------------------------------


def default_producer_id() -> str:
    return socket.gethostname()


def ledger_dir(state_dir: Path, run_id: str, producer_id: str, policy: str = "") -> Path:
    """A producer's ledger of one policy's topic (a multi-policy run: one per policy fed)."""
    run = Path(state_dir) / "producers" / run_id
    return (run / policy if policy else run) / producer_id


async def run_producer(
    config: SharedConfig,
    producers: ProducersConfig,
    *,
    groups: int | None = None,
    install_signals: bool = True,
    consumed_version: Callable[[], int | None] | None = None,
    on_worker: Callable[[RolloutWorker], Any] | None = None,
    peer_configs: Mapping[str, RoleConfig[ProducersConfig]] | None = None,
) -> WorkerReport:
    """Run a rollout worker for the producer role's config: the run's resolved shared
    sections (Kafka's address known) and ``[producers]``.

    Opens (and recovers) the ledger, connects the engine (``rollout.engine_url``, else an
    in-process engine), builds the task, starts a ``WeightFollower`` thread on the run's
    weight store (``rollout.follow_weights``: verified versions go to ``submit_version``;
    the announcements it reads tell the worker how far behind it is), and publishes until
    ``groups`` groups are delivered (default ``rollout.groups``) or a signal arrives.
    ``consumed_version`` is the trainer's consumed version for admission control (none by
    default); ``on_worker`` receives the worker before it runs (tests, extra wiring).
    ``peer_configs``: the resolved views of the peer policies ``rollout.peers`` names
    (a multi-policy run); each gets an engine, a follower, a ledger and a publisher here.
    """
    import signal

    from core.presence import Beacon
    from core.topic_reader import end_offsets
    from producers.catalog import make_task
    from producers.ledger import recover
    from producers.tasks import TaskContext

    rollout = producers.rollout
    producer_id = rollout.producer_id or default_producer_id()
    client_config = config.kafka.client_config()
    end_offsets(client_config, rollout.topic)  # fails early and clearly if the topic is missing
    metrics = ProducerMetrics()
    if rollout.metrics_port is not None:
        metrics.serve(rollout.metrics_port)

    backend: Backend
    tokenizer = None
    vocab_size: int | None = None  # an engine's vocabulary, to check observations against
    if rollout.engine_url:
        backend = await http_backend(
            rollout,
            producers.engine.model,
            ledger_dir(config.state_dir, config.run_id, producer_id, config.policy) / "weights",
        )
    else:
        backend = await local_backend(producers.engine, config.cache_dir, rollout.initial_version)
        tokenizer = backend.engine.tokenizer
        vocab_size = backend.engine.vocab_size

    missing = sorted(set(rollout.peers) - set(peer_configs or {}))
    if missing:
        raise ValueError(f"producers.rollout.peers names policies without a config: {missing}")
    ledger = Ledger(
        ledger_dir(config.state_dir, config.run_id, producer_id, config.policy),
        fsync=rollout.ledger_fsync,
    )
    ledger.open()
    peer_side = _PeerSide(config, producer_id, metrics, stop=threading.Event())
    publisher: GroupPublisher | None = None
    stats_reader: PromptStatsReader | None = None
    watcher: _WatchedListener | None = None
    follower: threading.Thread | None = None
    beacon: Beacon | None = None
    worker: RolloutWorker | None = None
    stop_following = threading.Event()
    try:
        await asyncio.to_thread(recover, ledger, client_config, rollout.topic)
        ledger.mark(await asyncio.to_thread(end_offsets, client_config, rollout.topic))
        for name in rollout.peers:
            await peer_side.add(name, (peer_configs or {})[name])
        task = make_task(
            rollout.task,
            rollout.task_options,
            TaskContext(config.cache_dir, tokenizer, peers=peer_side.peers),
        )
        publisher = GroupPublisher(
            client_config,
            rollout.topic,
            ledger,
            metrics,
            delivery_timeout_ms=rollout.delivery_timeout_ms,
            overrides=rollout.producer_overrides,
        )
        curriculum = None
        if rollout.curriculum.enabled:
            view = PromptStatsView(config.run_id)
            stats_reader = PromptStatsReader(client_config, rollout.curriculum.topic, view).start()
            curriculum = Curriculum(
                rollout.curriculum,
                view,
                on_skip=lambda reason: metrics.curriculum_skipped.labels(reason=reason).inc(),
            )
        worker = RolloutWorker(
            curriculum=curriculum,
            config=rollout,
            backend=backend,
            task=task,
            publisher=publisher,
            run_id=config.run_id,
            producer_id=producer_id,
            region=config.s3.name,
            metrics=metrics,
            consumed_version=consumed_version,
            announced_version=lambda: watcher.newest if watcher is not None else None,
            announcement=lambda: watcher.latest if watcher is not None else None,
            wait_for_first_version=rollout.follow_weights,
            mark=lambda: end_offsets(client_config, rollout.topic),
            vocab_size=vocab_size,
            policy=config.policy,
            peers=peer_side.peers,
            peer_publishers=peer_side.publishers,
        )
        if rollout.follow_weights:
            follower, watcher = _start_follower(config, worker, stop_following)
        peer_side.start_following(asyncio.get_running_loop())
        if on_worker is not None:
            on_worker(worker)
        if config.presence.enabled:
            beacon = Beacon(
                client_config,
                config.presence.topic,
                run=config.run_id,
                role="producer",
                instance=producer_id,
                interval_s=config.presence.interval_s,
                detail=_presence_detail(worker, rollout.engine_url),
            ).start()
            peer_side.announce()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM) if install_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, _on_signal, worker, sig)
        target = groups if groups is not None else rollout.groups
        progress = Progress(metrics, enabled=rollout.progress, total=target)
        try:
            report = await worker.run(target, progress=progress)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        if report.stop_requested:
            record = stop_record(report, ledger, rollout.stop_policy)
            ledger.stopped(record)
            peer_side.stopped(record)
            logger.info(
                "stopped (%s): %d group(s) in flight finished, %d aborted, %d unacknowledged",
                record.policy,
                len(record.finished),
                len(record.aborted),
                len(record.unacknowledged),
            )
        return report
    finally:
        if beacon is not None:
            stops = ledger.state.stops
            beacon.leave(
                {
                    **_presence_detail(worker, rollout.engine_url)(),
                    **(
                        {
                            "stop_policy": stops[-1].policy,
                            "finished": len(stops[-1].finished),
                            "aborted": len(stops[-1].aborted),
                        }
                        if stops
                        else {}
                    ),
                }
            )
        stop_following.set()
        await peer_side.close()
        if follower is not None:
            await asyncio.to_thread(follower.join, 30)
        if watcher is not None:
            watcher.close()
        if stats_reader is not None:
            stats_reader.close()
        if publisher is not None:
            await asyncio.to_thread(publisher.close)
        ledger.close()
        await backend.aclose()


def stop_record(report: WorkerReport, ledger: Ledger, policy: str) -> StopRecord:
    """Which groups in flight at the stop request were published (finished) and which
    were not (aborted), by the ledger: a group counts as published once it has a
    ``pending`` line, acknowledged or not."""
    state = ledger.state
    published = {gid for gid in report.inflight_at_stop if gid in state.delivered}
    published |= {gid for gid in report.inflight_at_stop if gid in state.pending}
    return StopRecord(
        policy=policy,
        finished=sorted(published),
        aborted=sorted(set(report.inflight_at_stop) - published),
        unacknowledged=sorted(state.pending),
    )


def _presence_detail(
    worker: RolloutWorker | None, engine_url: str | None
) -> Callable[[], dict[str, Any]]:
    """What a producer's heartbeat says about it."""

    def detail() -> dict[str, Any]:
        if worker is None:
            return {"engine": engine_url or "in-process"}
        return {
            "engine": engine_url or "in-process",
            "version": worker.version,
            "groups": worker.publisher.delivered_groups,
            "inflight": len(worker.inflight_groups),
        }

    return detail


class _WatchedListener:
    """An ``AnnouncementListener`` that remembers the newest announcement it has seen, so
    the worker knows how far behind it is even while the weight store is unreachable, and
    the trainer's trained version and pace for its credit."""

    def __init__(self, listener: Any) -> None:
        self.listener = listener
        self.newest: int | None = None
        self.latest: VersionAnnouncement | None = None

    def next(self, timeout_s: float) -> Any:
        announcement = self.listener.next(timeout_s)
        if announcement is not None:
            self.newest = max(self.newest or 0, announcement.version)
            if self.latest is None or announcement.version >= self.latest.version:
                self.latest = announcement
        return announcement

    def close(self) -> None:
        self.listener.close()


async def local_backend(
    engine_config: EngineConfig, cache_dir: Path, initial_version: int
) -> LocalBackend:
    """An engine in this process (built off the loop: loading a model takes a while),
    serving ``initial_version``."""
    from producers.inference_engine import engine_from_config

    engine = await asyncio.to_thread(engine_from_config, engine_config, cache_dir)
    engine.weight_version = str(initial_version)
    return LocalBackend(engine)


async def http_backend(rollout: RolloutConfig, model: str, weights_dir: Path) -> Backend:
    """The engine at ``rollout.engine_url``, checked to serve ``model`` (or
    ``rollout.expected_model``); new versions go through ``weights_dir``."""
    from producers.backends import HttpBackend
    from producers.client import EngineClient

    client = EngineClient(
        rollout.engine_url or "",
        connect_timeout=rollout.connect_timeout_s,
        request_timeout=rollout.request_timeout_s,
        retries=rollout.retries,
        retry_max_wait=rollout.retry_max_wait_s,
    )
    await client.check_model(rollout.expected_model or model)
    return HttpBackend(client, weights_dir)


class _PeerSide:
    """What a producer holds for its peer policies: per peer an engine (in-process, or
    the peer's ``rollout.engine_url``), a ledger and publisher on the peer's raw topic, a
    weight follower on the peer's lineage, and a heartbeat on the peer's roles topic."""

    def __init__(
        self,
        config: SharedConfig,
        producer_id: str,
        metrics: ProducerMetrics,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.producer_id = producer_id
        self.metrics = metrics
        self.stop = stop
        self.peers = Peers()
        self.publishers: dict[str, GroupPublisher] = {}
        self.configs: dict[str, RoleConfig[ProducersConfig]] = {}
        self.watchers: dict[str, _WatchedListener] = {}
        self.threads: list[threading.Thread] = []
        self.beacons: dict[str, Any] = {}
        self.ledgers: list[Ledger] = []

    async def add(self, name: str, config: RoleConfig[ProducersConfig]) -> None:
        from core.topic_reader import end_offsets
        from producers.ledger import recover

        peer, producers = config
        if peer.policy != name:
            raise ValueError(f"peer {name!r} was given the config of policy {peer.policy!r}")
        rollout = producers.rollout
        backend: Backend
        if rollout.engine_url:
            backend = await http_backend(
                rollout,
                producers.engine.model,
                ledger_dir(peer.state_dir, peer.run_id, self.producer_id, name) / "weights",
            )
        else:
            backend = await local_backend(producers.engine, peer.cache_dir, rollout.initial_version)
        self.peers.engines[name] = PeerEngine(
            name,
            backend,
            rollout.sampling,
            staleness_window=rollout.staleness_window,
            groups_per_version=rollout.groups_per_version,
            announcement=lambda: self.watchers[name].latest if name in self.watchers else None,
            wait_for_first_version=rollout.follow_weights,
            initial_version=rollout.initial_version,
        )
        client_config = peer.kafka.client_config()
        ledger = Ledger(
            ledger_dir(peer.state_dir, peer.run_id, self.producer_id, name),
            fsync=rollout.ledger_fsync,
        )
        ledger.open()
        self.ledgers.append(ledger)
        await asyncio.to_thread(recover, ledger, client_config, rollout.topic)
        ledger.mark(await asyncio.to_thread(end_offsets, client_config, rollout.topic))
        self.publishers[name] = GroupPublisher(
            client_config,
            rollout.topic,
            ledger,
            ProducerMetrics(),  # the peer's own counts: the served metrics are the driver's
            delivery_timeout_ms=rollout.delivery_timeout_ms,
            overrides=rollout.producer_overrides,
        )
        self.configs[name] = config

    def start_following(self, loop: asyncio.AbstractEventLoop) -> None:
        for name, (peer, producers) in self.configs.items():
            engine = self.peers[name]
            engine.bind(loop)
            if producers.rollout.follow_weights:
                thread, watcher = _start_follower(peer, engine, self.stop)
                self.threads.append(thread)
                self.watchers[name] = watcher

    def announce(self) -> None:
        """Heartbeats on each peer's roles topic: its trainer and ``rollstream roles``
        count this producer among the policy's producers."""
        from core.presence import Beacon

        for name, (peer, _) in self.configs.items():
            if peer.presence.enabled:
                self.beacons[name] = Beacon(
                    peer.kafka.client_config(),
                    peer.presence.topic,
                    run=peer.run_id,
                    role="producer",
                    instance=self.producer_id,
                    interval_s=peer.presence.interval_s,
                    detail=self._detail(name),
                ).start()

    def stopped(self, record: StopRecord) -> None:
        """Each peer ledger's ``stopped`` line: the peer groups of the driving groups in
        flight at the stop, finished (published) or aborted with them."""
        for name, publisher in self.publishers.items():
            state = publisher.ledger.state
            published = {*state.delivered, *state.pending}
            publisher.ledger.stopped(
                StopRecord(
                    policy=record.policy,
                    finished=[f"{g}-{name}" for g in record.finished if f"{g}-{name}" in published],
                    aborted=[f"{g}-{name}" for g in record.aborted],
                    unacknowledged=sorted(state.pending),
                )
            )

    def _detail(self, name: str) -> Callable[[], dict[str, Any]]:
        def detail() -> dict[str, Any]:
            rollout = self.configs[name].section.rollout
            return {
                "engine": rollout.engine_url or "in-process",
                "peer_of": self.config.policy,
                "version": self.peers[name].version,
                "groups": self.publishers[name].delivered_groups,
            }

        return detail

    async def close(self) -> None:
        """Release everything, each step on its own: one that fails is logged and the
        others still run (the driver's own resources are released after this)."""
        self.stop.set()
        steps: list[tuple[str, Callable[[], Any]]] = [
            *(
                (f"heartbeat of {n}", partial(b.leave, self._detail(n)()))
                for n, b in self.beacons.items()
            ),
            *((f"follower {t.name}", partial(asyncio.to_thread, t.join, 30)) for t in self.threads),
            *((f"announcements of {n}", w.close) for n, w in self.watchers.items()),
            *(
                (f"publisher of {n}", partial(asyncio.to_thread, p.close))
                for n, p in self.publishers.items()
            ),
            *((f"ledger {ledger.path}", ledger.close) for ledger in self.ledgers),
            *((f"engine of {n}", e.backend.aclose) for n, e in self.peers.engines.items()),
        ]
        for what, step in steps:
            try:
                done = step()
                if asyncio.iscoroutine(done) or isinstance(done, asyncio.Future):
                    await done
            except Exception as exc:
                logger.warning("closing the peers: %s failed: %r", what, exc)


def _start_follower(
    config: SharedConfig, worker: RolloutWorker | PeerEngine, stop: threading.Event
) -> tuple[threading.Thread, _WatchedListener]:
    """A ``WeightFollower`` thread feeding verified versions to ``worker.submit_version``."""
    from weights.announce import AnnouncementListener
    from weights.follower import Snapshot, WeightFollower
    from weights.store import WeightStore

    def on_version(snapshot: Snapshot) -> None:
        worker.submit_version(snapshot.version, snapshot.state)

    store = WeightStore.from_config(config.s3, config.run_id, config.policy)
    follower = WeightFollower.from_config(store, config.weights, on_version)
    listener = _WatchedListener(
        AnnouncementListener(config.kafka.client_config(), config.run_id, config.weights.topic)
    )
    thread = threading.Thread(
        target=follower.follow,
        args=(stop,),
        kwargs={"listener": listener, "poll_interval_s": config.weights.poll_interval_s},
        name="weight-follower",
        daemon=True,
    )
    thread.start()
    logger.info("following weights of run %s in %s", config.run_id, store.uri(store.run_prefix))
    return thread, listener


def _on_signal(worker: RolloutWorker, sig: int) -> None:
    import os
    import signal

    if worker.stopping:  # a second signal: leave now
        logger.warning("second signal: exiting without waiting for acknowledgements")
        os._exit(128 + sig)
    logger.info("%s received: finishing", signal.Signals(sig).name)
    worker.request_stop()
