"""Admission: whether the worker may start a new group now, and if not, why.

A new group starts only when the worker holds a version (when following weights, the
first one must arrive), fewer than ``max_inflight_groups`` are generating (the worker
counts those), fewer than ``max_undelivered_groups`` await Kafka's acknowledgement
(bounded memory while the broker is away), the engine's version is at most
``staleness_window`` versions behind the newest announced one (else the weight store is
lagging or down: wait for the follower), the worker has credit (below), and the engine is
at most ``staleness_window`` versions ahead of the trainer's consumed version when a
``consumed_version`` hook gives one. Each pause and its reason is logged once.

**Credit** (backpressure from the trainer's *trained* version, no setting needed). The
trainer announces, with every version, its step count (= the version) and how many groups
a step takes (``VersionAnnouncement.groups_per_step``; overridden by
``groups_per_version`` when set) and its staleness window (the worker uses the smaller of
that and its own ``staleness_window``). Several producers share one trainer's pace: the
trainer announces how many producers' groups it trained over its last window + 1 steps
(``VersionAnnouncement.producers``), and each producer's share of a step is
``groups_per_step / producers`` groups (a producer that just joined is counted once its
first groups are trained). ``lead`` is how many trainer steps of data this worker started
beyond the trainer's trained version: each group started adds 1 / share (at the share in
force when it started), each version the trainer announces takes 1 away, never below 0. A
new group starts only while lead + (trained version - engine version) < window + 1: the
group then reaches the trainer at most ``window`` versions after the version that
generates it. A stopped trainer announces nothing, so generation pauses once the lead
reaches the window; it resumes with the next announcement. Without announcements (not
following weights) credit counts the versions the engine loads. Each peer policy a
group calls has its own credit against its own trainer (``producers.rollout.peers``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from producers.config import RolloutConfig
from producers.rollout.credit import AdmissionCredit
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.peers import Peers
from producers.rollout.publishing import Outbox
from producers.rollout.versions import EngineVersions
from schemas.control import VersionAnnouncement
from schemas.trajectory import NO_VERSION

logger = logging.getLogger(__name__)


@dataclass
class TrainerSignals:
    """What the worker hears of its trainer, each optional (none: a bare engine)."""

    # the newest announcement: trained version, pace (groups a step, producers), window
    announcement: Callable[[], VersionAnnouncement | None] | None = None
    # the newest announced version (known even while the weight store is unreachable)
    announced_version: Callable[[], int | None] | None = None
    # the version the trainer last consumed data of
    consumed_version: Callable[[], int | None] | None = None
    # weights come from a follower: no group before its first version is loaded
    wait_for_first_version: bool = False


class Admission:
    """The admission rule of the module doc, read at each group start."""

    def __init__(
        self,
        config: RolloutConfig,
        versions: EngineVersions,
        outbox: Outbox,
        metrics: ProducerMetrics,
        *,
        trainer: TrainerSignals | None = None,
        peers: Peers | None = None,
    ) -> None:
        self.config = config
        self.versions = versions
        self.outbox = outbox
        self.metrics = metrics
        self.trainer = trainer or TrainerSignals()
        self.peers = peers or Peers()
        self.credit = AdmissionCredit(config.groups_per_version)
        self._paused_for: str | None = None

    def admit(self) -> bool:
        """Whether a new group may start now; a pause and the resumption are logged once."""
        why = self.pause_reason()
        if why is None:
            self.metrics.admission_paused.set(0)
            if self._paused_for is not None:
                self._paused_for = None
                logger.info("admission resumed")
            return True
        self.metrics.admission_paused.set(1)
        if why != self._paused_for:
            self._paused_for = why
            logger.info("admission paused: %s", why)
        return False

    def started(self) -> None:
        """A group started: its credit is charged, to this policy and to every peer's."""
        self.credit.started()
        for peer in self.peers.engines.values():
            peer.started()

    def pause_reason(self) -> str | None:
        """Why no new group may start now, or None."""
        version = self.versions.version
        trainer = self.trainer.announcement() if self.trainer.announcement is not None else None
        window = self.config.staleness_window
        if trainer is not None and trainer.max_staleness is not None:
            window = min(window, trainer.max_staleness)
        if version == NO_VERSION:
            return "waiting for the first policy version from the weight follower"
        if trainer is not None and trainer.paused and not self.config.ignore_trainer_pause:
            return (
                f"the trainer paused generation at v{trainer.version}: {trainer.paused} "
                "(a later version clears it; [producers.rollout] ignore_trainer_pause "
                "overrides it)"
            )
        hook = self.trainer.announced_version
        announced = hook() if hook is not None else None
        if trainer is not None:
            announced = max(announced or 0, trainer.version)
        if announced is not None:
            self.versions.note_announced(announced)
            if announced - version > window:
                return (
                    f"serving v{version} but v{announced} is announced, more than the "
                    f"staleness window ({window}) behind: waiting for the weight follower "
                    "(is the weight store reachable?)"
                )
        why = self.credit.pause(trainer, window, version)
        self.metrics.lead.set(self.credit.lead)
        if why is not None:
            return why
        hook = self.trainer.consumed_version
        consumed = hook() if hook is not None else None
        if consumed is not None:
            ahead = version - consumed
            self.metrics.consumed_lag.set(ahead)
            if ahead > window:
                return (
                    f"v{version} is {ahead} versions ahead of the trainer's consumed "
                    f"version {consumed} (staleness window {window})"
                )
        return self._backlog() or self._peer_pause()

    def _backlog(self) -> str | None:
        limit = self.config.max_undelivered_groups
        own = self.outbox.publisher.undelivered_groups
        if own >= limit:
            return f"{own} groups await Kafka acknowledgement"
        for name, publisher in self.outbox.peer_publishers.items():
            if publisher.undelivered_groups >= limit:
                return (
                    f"{publisher.undelivered_groups} groups of peer policy {name!r} await "
                    "Kafka acknowledgement"
                )
        return None

    def _peer_pause(self) -> str | None:
        for peer in self.peers.engines.values():  # each peer policy's own admission
            if (why := peer.pause_reason()) is not None:
                return why
        return None
