"""Admission credit: how far ahead of a trainer a producer may start groups.

The rule (told in full by ``producers.rollout.admission``): ``lead`` counts the trainer steps of
data started beyond the trainer's trained version, each group started adds 1 / share,
each newly trained version takes 1 away; a new group starts only while lead + (trained
version - engine version) < window + 1. One ``AdmissionCredit`` per policy a producer
feeds: its own policy's and, in a multi-policy episode, every peer policy's, each against
that policy's own trainer announcements.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.control import VersionAnnouncement


@dataclass
class AdmissionCredit:
    """The credit of one producer towards one policy's trainer."""

    groups_per_version: float | None = None  # a configured share; None: the trainer's pace
    lead: float = 0.0  # trainer steps of data started beyond its trained version
    share: float | None = None  # groups of a trainer step that are this producer's
    settled_version: int | None = None  # trained version ``lead`` was last settled at

    def started(self) -> None:
        """A group was started at the share in force."""
        if self.share is not None:
            self.lead += 1 / self.share

    def refund(self) -> None:
        """A started group that will never reach this trainer gives its charge back."""
        if self.share is not None:
            self.lead = max(0.0, self.lead - 1 / self.share)

    def pause(
        self, trainer: VersionAnnouncement | None, window: int, engine_version: int
    ) -> str | None:
        """Why the credit is used up, or None."""
        share: float | None = self.groups_per_version
        if share is None and trainer is not None and trainer.groups_per_step is not None:
            # producers share the trainer's pace: N of them each start 1/N of a step
            share = trainer.groups_per_step / max(1, trainer.producers or 1)
            # one group never charges more than the window: a forged pace in a run that
            # does not sign announcements holds a producer up for a window, not for good
            share = max(share, 1 / (window + 1))
        self.share = share
        if share is None:
            return None  # no announced pace and none configured: no credit limit
        # the trainer's trained version (without announcements: the version loaded)
        trained = max(trainer.version, engine_version) if trainer is not None else engine_version
        if self.settled_version is None:
            self.settled_version = trained
        elif trained > self.settled_version:
            self.lead = max(0.0, self.lead - (trained - self.settled_version))
            self.settled_version = trained
        behind = trained - engine_version  # the engine's own lag behind the trainer
        if self.lead + behind >= window + 1 - 1e-9:
            return (
                f"{self.lead:.1f} steps of data started ahead of the trainer's v{trained} "
                f"(a share of {share:g} groups a step"
                + (f", engine {behind} version(s) behind" if behind else "")
                + f"; staleness window {window}): waiting for the trainer"
            )
        return None
