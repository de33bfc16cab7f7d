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
    """The newest trainer version announced for one run (``NO_VERSION`` until one is)."""

    def __init__(self) -> None:
        self._version = NO_VERSION
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def version(self) -> int:
        return self._version

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
    """``admitted`` or not; ``staleness`` in versions (``NO_VERSION`` when the trainer
    version is unknown); ``limit`` the most versions of lag admitted at this trainer
    version (for ``StaleRecord.max_staleness``)."""

    admitted: bool
    staleness: int
    limit: int


class StalenessPolicy:
    """Applies ``StalenessConfig`` to a record's oldest segment version.

    A record is always admitted while no trainer version is known (nothing to compare
    with), and a record from a version the stream has not heard of yet (negative
    staleness: the announcement is still on its way) counts as fresh.
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

    def judge(self, min_version: int, trainer_version: int) -> Verdict:
        if trainer_version == NO_VERSION:
            return Verdict(True, NO_VERSION, self.config.max_staleness)
        staleness = trainer_version - min_version
        limit = self.limit(trainer_version)
        return Verdict(staleness <= limit, staleness, limit)

    def oldest_admitted(self, trainer_version: int) -> int:
        """Oldest version still admitted (snapshots below it can be dropped)."""
        if trainer_version == NO_VERSION:
            return 0
        return max(0, trainer_version - self.limit(trainer_version))
