"""Reads ``policy.versions`` into a ``VersionTracker``, and says when it has caught up.

The staleness filter must not judge records before it knows the trainer's version: a
worker that starts (or restarts) would otherwise admit everything it reads in its first
seconds. ``VersionReader`` runs the one reader of that topic
(``weights.announce.AnnouncementListener``) in a thread and sets ``caught_up`` once it
has read up to the end offsets it saw when it started; the stream waits for that before
processing its first record. A failing read is retried with back-off; it never counts
as caught up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from confluent_kafka import KafkaException

from core.config import RetryConfig
from core.retry import retrying
from streams.staleness import VersionTracker
from weights.announce import AnnouncementListener

log = logging.getLogger(__name__)


class VersionReader:
    """A daemon thread feeding ``tracker`` with the announced versions of ``run``."""

    def __init__(
        self,
        client_config: Mapping[str, str],
        topic: str,
        run: str,
        tracker: VersionTracker,
        on_version: Callable[[int], None] | None = None,
    ) -> None:
        self.client_config = dict(client_config)
        self.topic = topic
        self.run = run
        self.tracker = tracker
        self.on_version = on_version
        self.caught_up = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> VersionReader:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="version-reader", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        listener = AnnouncementListener(self.client_config, self.run, self.topic)
        policy = RetryConfig(initial_s=0.5, max_s=30.0)
        try:
            while not self._stop.is_set():
                # a broker hiccup is retried with back-off; it never counts as caught up
                for attempt in retrying(policy, (KafkaException,), f"reading {self.topic}"):
                    with attempt:
                        announcement = listener.next(0.5)
                        if not self.caught_up.is_set() and listener.caught_up:
                            self.caught_up.set()
                if (
                    announcement is not None
                    and self.tracker.observe(announcement.version)
                    and self.on_version is not None
                ):
                    self.on_version(announcement.version)
        finally:
            listener.close()
