"""Reads ``policy.versions`` into a ``VersionTracker``, and says when it has caught up.

The staleness filter must not judge records before it knows the trainer's version: a
worker that starts (or restarts) would otherwise admit everything it reads in its first
seconds. ``VersionReader`` runs the one reader of that topic
(``weights.announce.AnnouncementListener``) in a thread and sets ``caught_up`` once it
has read up to the end offsets it saw when it started; the stream waits for that before
processing its first record.

It never fails open. Any failure (the topic or broker unavailable, a consumer error, an
``on_version`` callback that raises, a bug) is counted in
``rollstream_streams_version_read_errors_total{kind}``, clears ``caught_up`` and is
retried with back-off (``core.retry``) until it works; the thread only ends on
``stop``. A version whose ``on_version`` callback failed is handed to it again before
anything newer is read. A malformed announcement, or one ``confirm`` finds no genuine
manifest for in the weight store (``weights.trust``), is counted and skipped: it is not
an outage, and it never moves the clock. ``VersionVoucher`` answers for versions the
announcements have not reached yet: the weight store's word.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from botocore.exceptions import BotoCoreError, ClientError
from prometheus_client import CollectorRegistry, Counter, Gauge

from core.config import ConfigurationError, RetryConfig
from core.retry import retrying
from schemas.control import VersionAnnouncement
from schemas.trajectory import NO_VERSION
from streams.staleness import VersionTracker
from weights.announce import AnnouncementListener
from weights.errors import FormatError, ObjectMissing
from weights.store import WeightStore
from weights.trust import Trust

log = logging.getLogger(__name__)

#: Back-off between failed reads: quick at first, never more than 30 s apart.
DEFAULT_RETRY = RetryConfig(initial_s=0.5, max_s=30.0)


class VersionReadError(RuntimeError):
    """The announcement topic could not be read (raised to back off, then retried)."""


class VersionReaderMetrics:
    """``rollstream_streams_version_read_errors_total{kind}`` and
    ``rollstream_streams_version_reader_failing`` (1 while reads fail), on a registry
    the caller owns (or a new one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.errors = Counter(
            "rollstream_streams_version_read_errors",
            "Failed reads of the version topic, by kind "
            "(unavailable, broker, consumer, malformed, forged, callback, exception).",
            ["kind"],
            registry=self.registry,
        )
        self.failing = Gauge(
            "rollstream_streams_version_reader_failing",
            "1 while the version reader is retrying a failed read, else 0.",
            registry=self.registry,
        )


class VersionReader:
    """A daemon thread feeding ``tracker`` with the announced versions of ``run``."""

    def __init__(
        self,
        client_config: Mapping[str, str],
        topic: str,
        run: str,
        tracker: VersionTracker,
        on_version: Callable[[int], None] | None = None,
        *,
        registry: CollectorRegistry | None = None,
        retry: RetryConfig = DEFAULT_RETRY,
        confirm: Callable[[VersionAnnouncement], bool | None] | None = None,
    ) -> None:
        self.client_config = dict(client_config)
        self.topic = topic
        self.run = run
        self.tracker = tracker
        self.on_version = on_version
        self.retry = retry
        self.confirm = confirm  # the weight store's word on each announcement
        self.metrics = VersionReaderMetrics(registry)
        self.caught_up = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: AnnouncementListener | None = None
        self._outage: str | None = None  # what the listener reported during this read
        self._undelivered: int | None = None  # newest version on_version has not taken

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

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                attempts = retrying(
                    self.retry,
                    (Exception,),
                    f"reading {self.topic}",
                    stop_event=self._stop,
                    on_retry=self._failed,
                )
                try:
                    for attempt in attempts:
                        with attempt:
                            self._read_once()
                except Exception:
                    if not self._stop.is_set():  # only ``stop`` ends the retries
                        raise
        finally:
            if self._listener is not None:
                self._listener.close()

    def _read_once(self) -> None:
        """One read: deliver what is pending, take the newest announcement, and raise
        (so that it is retried with back-off) on anything that went wrong."""
        self._outage = None
        if self._listener is None:
            self._listener = AnnouncementListener(
                self.client_config,
                self.run,
                self.topic,
                on_error=self._listener_error,
                confirm=self.confirm,
            )
        if self._undelivered is not None:
            self._deliver(self._undelivered)
        announcement = self._listener.next(0.5)
        if announcement is not None and self.tracker.observe(announcement.version):
            self._undelivered = announcement.version
            self._deliver(announcement.version)
        if self._outage is not None:
            raise VersionReadError(f"{self.topic}: {self._outage}")
        self.metrics.failing.set(0)
        if self._listener.caught_up:
            self.caught_up.set()

    def _deliver(self, version: int) -> None:
        if self.on_version is not None:
            try:
                self.on_version(version)
            except Exception as err:
                raise _CallbackFailed(version, err) from err
        if self._undelivered == version:
            self._undelivered = None

    def _listener_error(self, kind: str, detail: str) -> None:
        self.metrics.errors.labels(kind=kind).inc()
        if kind not in ("malformed", "forged"):  # a bad record is skipped, not an outage
            self._outage = f"{kind}: {detail}"

    def _failed(self, err: BaseException | None) -> None:
        """Before each back-off: no longer caught up; count what was not counted yet."""
        self.caught_up.clear()
        self.metrics.failing.set(1)
        if isinstance(err, _CallbackFailed):
            self.metrics.errors.labels(kind="callback").inc()
        elif not isinstance(err, VersionReadError):  # listener errors are counted already
            self.metrics.errors.labels(kind="exception").inc()
            log.error("reading %s failed", self.topic, exc_info=err)


class _CallbackFailed(RuntimeError):
    def __init__(self, version: int, err: Exception) -> None:
        super().__init__(f"on_version({version}) raised {type(err).__name__}: {err}")


class VersionVoucher:
    """Whether the weight store holds a genuine manifest of a version no announcement has
    reached the stream with yet.

    A broker outage delays announcements while producers, which follow the store, go on
    generating with newer versions; their records then reach the stream ahead of its
    clock. Asked about such a version, the voucher reads its manifest (``weights.trust``:
    signed with the run's key, naming the run and version). A version found genuine is
    remembered, with every version before it; one that is not (missing, forged, the store
    not answering) is asked about again only after ``recheck_s``, so a stream of records
    claiming it costs one read per interval, not one per record. The store is made on the
    first question (``store``: a factory), so a worker whose run never needs one (no
    record ever ahead of the clock) starts without S3.
    """

    def __init__(
        self,
        store: Callable[[], WeightStore],
        trust: Trust,
        *,
        recheck_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_store = store
        self._store: WeightStore | None = None
        self.trust = trust
        self.recheck_s = recheck_s
        self.clock = clock
        self._newest = NO_VERSION
        self._refused: dict[int, float] = {}  # version -> when it may be asked about again

    def vouches(self, version: int) -> bool:
        """Whether ``version`` was published (blocking: a store read at most)."""
        if version <= self._newest:
            return True
        now = self.clock()
        if self._refused.get(version, now) > now:
            return False
        try:
            if self._store is None:
                self._store = self._make_store()
            self.trust.manifest(self._store, version)
        except (ObjectMissing, FormatError, BotoCoreError, ClientError, ConfigurationError) as err:
            if len(self._refused) > 1024:  # claims of versions never published: forget old ones
                self._refused.clear()
            self._refused[version] = now + self.recheck_s
            log.info("v%d claimed by a record is not in the weight store: %s", version, err)
            return False
        self._newest = version
        return True
