"""Publishing: a group's records, built and validated, out to Kafka, and the ledger marks.

``RecordBuilder`` turns samples and episodes into ``Trajectory`` records (rewards computed,
each record validated by ``schemas.validation``: an invalid one is a bug or a broken
engine and stops the worker), and the peer policies' turns of a group's episodes into
groups of their own. ``Outbox`` holds the publishers the worker feeds (its own policy's
raw topic and each peer policy's): a group counts once Kafka acknowledged all G records
(the ledger says so durably), the partitions' end offsets are marked in each ledger now
and then (they bound a restart's recovery scan), and ``drain`` waits for what is still
unacknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from producers.rollout.episodes import EpisodeResult
from producers.rollout.generation import Sample, now_ms
from producers.rollout.group_publisher import GroupPublisher
from producers.rollout.metrics import ProducerMetrics, Progress
from producers.rollout.peers import Peers
from producers.tasks.base import Prompt, Task
from producers.tasks.peers import PeerSample
from producers.tasks.rewards import Score
from schemas.trajectory import Trajectory
from schemas.validation import ValidationLimits, validate

logger = logging.getLogger(__name__)


class InvalidTrajectory(RuntimeError):
    """A record the worker built failed validation: a bug or a broken engine."""


@dataclass(frozen=True)
class ProducerIdentity:
    """Who made a record: the run, this producer, its region and its policy."""

    run_id: str
    producer_id: str
    region: str
    policy: str = ""


async def task_scores(task: Task, prompt: Prompt, responses: list[list[int]]) -> list[Score]:
    """A group's scores by the task's ``score_group`` where it has one, else by its
    per-sample ``reward``."""
    score_group = getattr(task, "score_group", None)
    if score_group is None:
        return [Score(*task.reward(prompt, ids)) for ids in responses]
    return list(await score_group(prompt, responses))


def _response_fields(
    policy: str, prompt_ids: Sequence[int], sample: Sample, score: Score, created_ms: int
) -> dict[str, Any]:
    """The record fields of one scored single-turn response of ``policy`` to
    ``prompt_ids`` (``Trajectory.create`` keywords); the caller adds the ids."""
    details = score.details
    if sample.interruptions:
        details = {**details, "interruptions": sample.interruptions}
    return {
        "policy": policy,
        "prompt_ids": prompt_ids,
        "response_ids": sample.response_ids,
        "logp_infer": sample.logprobs,
        "segment_versions": [v for v, _ in sample.segments],
        "segment_lengths": [n for _, n in sample.segments],
        "reward": float(score.reward),
        "reward_details": details,
        "finish_reason": sample.finish_type,
        "finished_at_ms": max(created_ms, sample.finished_at_ms),
    }


@dataclass(eq=False)
class RecordBuilder:
    """Validated records of a task's groups, for this producer's policy and its peers'."""

    identity: ProducerIdentity
    task: Task
    metrics: ProducerMetrics
    peers: Peers = field(default_factory=Peers, kw_only=True)
    limits: ValidationLimits = field(default_factory=ValidationLimits, kw_only=True)

    async def group_trajectories(
        self, prompt: Prompt, group_id: str, samples: Sequence[Sample], created_ms: int
    ) -> list[Trajectory]:
        """The records of a single-turn group, scored together."""
        scores = await self.scores(prompt, [sample.response_ids for sample in samples])
        return [
            self.trajectory(prompt, group_id, i, len(samples), sample, created_ms, score)
            for i, (sample, score) in enumerate(zip(samples, scores, strict=True))
        ]

    async def scores(self, prompt: Prompt, responses: list[list[int]]) -> list[Score]:
        """A group's scores: by the task's ``score_group`` where it has one (a whole
        group at once, reward functions' failures contained and counted here), else by
        its per-sample ``reward``."""
        scores = await task_scores(self.task, prompt, responses)
        for score in scores:
            for function in score.details.get("reward_errors", {}):
                self.metrics.reward_errors.labels(function=function).inc()
        return scores

    def trajectory(
        self,
        prompt: Prompt,
        group_id: str,
        index: int,
        size: int,
        sample: Sample,
        created_ms: int,
        score: Score,
    ) -> Trajectory:
        """The record of a single-turn ``Sample`` with its score."""
        fields = _response_fields(self.identity.policy, prompt.ids, sample, score, created_ms)
        return self._new_record(group_id, index, size, created_ms, **fields)

    def episode_trajectory(
        self,
        prompt: Prompt,
        group_id: str,
        index: int,
        size: int,
        episode: EpisodeResult,
        created_ms: int,
    ) -> Trajectory:
        """The record of one episode (the environment scored it)."""
        details = dict(episode.details)
        if episode.interruptions:
            details["interruptions"] = episode.interruptions
        self.metrics.episodes.labels(end=episode.end.value).inc()
        self.metrics.tool_calls.inc(episode.tool_calls)
        return self._new_record(
            group_id,
            index,
            size,
            created_ms,
            policy=self.identity.policy,
            prompt_ids=prompt.ids,
            **episode.trajectory_fields(self.identity.policy),
            reward_details=details,
            finished_at_ms=max(created_ms, now_ms()),
        )

    def peer_groups(
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
        """The record of a peer policy's turn: a single-turn response of that policy."""
        turn = sample.turn
        response = Sample(
            response_ids=turn.response_ids,
            logprobs=turn.logprobs,
            segments=[[turn.version, len(turn.response_ids)]],
            finish_type=turn.finish_type,
            finished_at_ms=turn.finished_at_ms,
        )
        score = Score(sample.reward, sample.details)
        fields = _response_fields(turn.policy, turn.prompt_ids, response, score, created_ms)
        return self._new_record(group_id, index, size, created_ms, **fields)

    def _new_record(
        self, group_id: str, index: int, size: int, created_ms: int, **fields: Any
    ) -> Trajectory:
        """A validated record of sample ``index`` of a group (of any policy it feeds): every
        record the worker publishes is built here."""
        traj = Trajectory.create(
            run_id=self.identity.run_id,
            trajectory_id=f"{group_id}-{index}",
            group_id=group_id,
            group_size=size,
            sample_index=index,
            producer_id=self.identity.producer_id,
            region=self.identity.region,
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


class Outbox:
    """The publishers a worker feeds: its own policy's and each peer policy's.

    ``mark`` returns the end offsets of the worker's own topic (recorded in its ledger
    every ``mark_interval_s``); each peer topic's are read from its publisher."""

    def __init__(
        self,
        publisher: GroupPublisher,
        peer_publishers: Mapping[str, GroupPublisher] | None = None,
        *,
        mark: Callable[[], Mapping[int, int]] | None = None,
    ) -> None:
        self.publisher = publisher
        self.peer_publishers = dict(peer_publishers or {})
        self.mark = mark

    @property
    def metrics(self) -> ProducerMetrics:
        """The served metrics: those of the worker's own publisher."""
        return self.publisher.metrics

    @property
    def publishers(self) -> tuple[GroupPublisher, ...]:
        return (self.publisher, *self.peer_publishers.values())

    async def publish(
        self,
        group_id: str,
        trajectories: Sequence[Trajectory],
        peer_groups: Sequence[tuple[str, str, list[Trajectory]]] = (),
    ) -> None:
        """A group to the worker's topic, then its peer groups to their policies' topics."""
        await self.publisher.publish_async(group_id, trajectories)
        for policy, peer_group_id, records in peer_groups:
            await self.peer_publishers[policy].publish_async(peer_group_id, records)

    async def run(self, progress: Progress | None, mark_interval_s: float) -> None:
        """Serve delivery reports (a delivery error raises: it stops the worker), refresh
        ``progress`` and mark the ledgers, until cancelled."""
        last_mark = time.monotonic()
        last_progress = 0.0
        while True:
            for publisher in self.publishers:
                publisher.poll(0)
            now = time.monotonic()
            if progress is not None and now - last_progress >= 0.25:
                last_progress = now
                progress.update()
            if self.mark is not None and now - last_mark >= mark_interval_s:
                last_mark = now
                try:
                    offsets = await asyncio.to_thread(self.mark)
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

    async def drain(self, stopping: asyncio.Event, stopping_limit_s: float = 30.0) -> None:
        """Wait until Kafka acknowledged every published group. Once ``stopping`` is set
        (a signal), give up after ``stopping_limit_s``: what is left stays ``pending`` in
        the ledger and the next start's recovery settles it."""
        began = last_log = time.monotonic()
        publishers = self.publishers
        while any(p.undelivered_groups for p in publishers):
            for publisher in publishers:
                publisher.poll(0)
            now = time.monotonic()
            if stopping.is_set() and now - began > stopping_limit_s:
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
