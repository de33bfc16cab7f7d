"""The trainer's current version and the staleness rule (window or Mu-GRPO stages).

``VersionTracker`` is fed from ``policy.versions`` announcements (a background thread) and
read by the processing loop; it only moves forward. ``StalenessPolicy`` decides, from the
tracked version and a record's oldest segment version, whether the record is admitted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from schemas.trajectory import NO_VERSION
from streams.config import StalenessConfig


class VersionTracker:
    """The newest trainer version announced for one run (``NO_VERSION`` until one is):
    the staleness clock. Beside it, ``vouched``: the newest version the weight store was
    found to hold a genuine manifest of, ahead of the announcements (a broker outage
    delays them); it widens what is not ``future`` and never moves the clock."""

    def __init__(self) -> None:
        self._version = NO_VERSION
        self._vouched = NO_VERSION
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def version(self) -> int:
        return self._version

    @property
    def vouched(self) -> int:
        return self._vouched

    def vouch(self, version: int) -> None:
        """The store holds a genuine ``version`` (so every version before it was published)."""
        with self._lock:
            self._vouched = max(self._vouched, version)

    def observe(self, version: int) -> bool:
        """Record an announced version; returns True if it is newer than the one held."""
        with self._lock:
            if version <= self._version:
                return False
            self._version = version
            self._changed.notify_all()
            return True

    def wait_for(self, version: int, timeout: float) -> bool:
        """Block until the tracked version is at least ``version`` (tests, tools)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._version >= version, timeout)


@dataclass(frozen=True, slots=True)
class Verdict:
    """``admitted`` or not; ``staleness`` in versions, never negative (0 also while the
    trainer version is unknown); ``limit`` the most versions of lag admitted at this
    trainer version (for ``StaleRecord.max_staleness``); ``future``: the record claims a
    version beyond the newest announced one plus the allowance (never admitted)."""

    admitted: bool
    staleness: int
    limit: int
    future: bool = False


class StalenessPolicy:
    """Applies ``StalenessConfig`` to a record's segment versions.

    One clock: the newest version announced on ``policy.versions`` (``VersionTracker``).
    Staleness = that version - the record's oldest segment version, floored at 0: a
    record may come from a version up to ``future_allowance`` versions *ahead* of the
    clock (its announcement is still on its way to the stream), or up to a version the
    weight store vouches for (``VersionTracker.vouched``), and then counts as fresh
    (staleness 0). A record whose newest segment version is further ahead claims a
    version that was never published: ``future``. While no version is known (nothing
    announced yet) nothing can be compared: every record is admitted with staleness 0.
    """

    def __init__(self, config: StalenessConfig) -> None:
        self.config = config

    def limit(self, trainer_version: int) -> int:
        """Most versions of lag admitted while the trainer is at ``trainer_version``."""
        if self.config.mode == "window":
            return self.config.max_staleness
        stage = trainer_version // self.config.stage_versions
        oldest_stage = max(0, stage - self.config.stages_admitted)
        return trainer_version - oldest_stage * self.config.stage_versions

    def judge(
        self,
        min_version: int,
        trainer_version: int,
        max_version: int | None = None,
        vouched: int = NO_VERSION,
    ) -> Verdict:
        """The verdict on a record whose segment versions span ``[min_version,
        max_version]`` (``max_version`` defaults to ``min_version``) at ``trainer_version``,
        the store vouching for versions up to ``vouched``."""
        if trainer_version == NO_VERSION:
            return Verdict(True, 0, self.config.max_staleness)
        newest = min_version if max_version is None else max_version
        limit = self.limit(trainer_version)
        if newest > self.newest_known(trainer_version, vouched):
            return Verdict(False, 0, limit, future=True)
        staleness = max(0, trainer_version - min_version)
        return Verdict(staleness <= limit, staleness, limit)

    def newest_known(self, trainer_version: int, vouched: int = NO_VERSION) -> int:
        """The newest version a record may claim without being ``future``."""
        return max(trainer_version + self.config.future_allowance, vouched)

    def oldest_admitted(self, trainer_version: int) -> int:
        """Oldest version still admitted (snapshots below it can be dropped)."""
        if trainer_version == NO_VERSION:
            return 0
        return max(0, trainer_version - self.limit(trainer_version))
