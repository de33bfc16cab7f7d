"""Version following: which weights the engine serves, and changing them safely.

A ``WeightFollower`` thread (``start_follower``) offers each verified version through
``submit`` (thread-safe); ``EngineVersions`` loads it into the engine between engine
calls. Every engine call goes through ``EngineVersions.call``, behind a gate that a
version change closes, so that weights change only while no call is in flight and every
token's version is known exactly (the engine's own ``weight_version`` is used when it
reports an integer). A change closes the gate, then per ``version_policy``:

- ``finish``: waits for the calls in flight to finish on the old weights;
- ``interrupt``: aborts them (the generator keeps their tokens and continues each cut
  sample from prompt + partial response on the new weights: a partial rollout with two or
  more segments);
- ``abort``: aborts them (the generator discards their tokens and regenerates them).

An engine that is away while loading is retried with back-off; an engine that restarted
and serves its initial weights again is given the current version once more.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from core.config import SharedConfig
from producers.engine.backends import Backend
from producers.engine.client import EngineError, EngineUnavailable, GenerateOutput
from producers.engine.streaming import TokenProgress
from producers.rollout.metrics import ProducerMetrics
from schemas.control import VersionAnnouncement
from schemas.trajectory import NO_VERSION

logger = logging.getLogger(__name__)


class Stopped(Exception):
    """The worker is stopping: the group in hand is dropped."""


@dataclass
class StopSignals:
    """The worker's two stop levels, shared by its parts."""

    requested: asyncio.Event = field(default_factory=asyncio.Event)  # no new groups
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # abandon those in flight


class OfferedWeights:
    """Weights offered to an engine and not loaded yet, the newest winning: an offer made
    while another waits replaces it, and ``take`` waits for the next one."""

    def __init__(self) -> None:
        self._waiting: tuple[int, Mapping[str, Any]] | None = None
        self._ready = asyncio.Event()

    @property
    def empty(self) -> bool:
        return self._waiting is None

    def newest(self, loaded: int) -> int:
        """The newest version of ``loaded`` and the one waiting: an offer must beat it."""
        return max(loaded, self._waiting[0] if self._waiting else NO_VERSION)

    def put(self, version: int, state_dict: Mapping[str, Any]) -> None:
        self._waiting = (version, state_dict)
        self._ready.set()

    async def take(self) -> tuple[int, Mapping[str, Any]]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._waiting is not None:
                offer, self._waiting = self._waiting, None
                return offer


class EngineVersions:
    """The engine's weights: the version it serves, offers of newer ones, and the gate
    that keeps engine calls and weight changes apart."""

    def __init__(
        self,
        backend: Backend,
        policy: str,
        metrics: ProducerMetrics,
        stop: StopSignals,
        *,
        initial_version: int = 0,
        wait_for_first_version: bool = False,
    ) -> None:
        self.backend = backend
        self.policy = policy  # version_policy: finish, interrupt or abort
        self.metrics = metrics
        self.stop = stop
        # NO_VERSION until the first version is loaded, when the engine's own weights
        # are not a published version (weights come from the WeightFollower).
        self.wait_for_first_version = wait_for_first_version
        self.version = NO_VERSION if wait_for_first_version else initial_version
        self.latest_version = self.version
        self.applied: list[int] = []  # versions loaded, in order
        try:  # so that submit works before the worker runs (e.g. a follower's first sync)
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._offers = OfferedWeights()
        # The weights the engine was last given: reloaded if it restarts and forgets them.
        self._loaded: tuple[int, Mapping[str, Any]] | None = None
        self._inflight_calls = 0
        self.inflight_rids: set[str] = set()
        self.swaps = 0  # incremented when a version change starts
        self._engine_version_warned = False
        metrics.version.set(self.version)
        metrics.latest_version.set(self.version)

    # --- offers --------------------------------------------------------------------------

    def submit(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Offer new weights from any thread (e.g. a ``WeightFollower`` callback)."""
        if self.loop is None:
            raise RuntimeError("the worker is not running")
        self.loop.call_soon_threadsafe(self.offer, version, state_dict)

    def offer(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Offer new weights from the loop: loaded by ``run`` unless a newer one is."""
        if version <= self._offers.newest(self.version):
            logger.info("version %d ignored: not newer than the current one", version)
            return
        self._offers.put(version, state_dict)
        self.latest_version = max(self.latest_version, version)
        self.metrics.latest_version.set(self.latest_version)
        self.metrics.version_lag.set(self.latest_version - self.version)

    def note_announced(self, announced: int) -> None:
        """A version was announced (it may not be loadable yet): the lag counts it."""
        if announced > self.latest_version:
            self.latest_version = announced
            self.metrics.latest_version.set(announced)
        self.metrics.version_lag.set(self.latest_version - self.version)

    # --- loading -------------------------------------------------------------------------

    async def adopt_engine_version(self) -> None:
        """Start from the version the engine says it serves (unless following weights)."""
        if self.wait_for_first_version:
            return  # the follower's first version replaces whatever the engine holds
        info = await self.backend.model_info()
        try:
            reported = int(info.get("weight_version"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        if reported != self.version:
            logger.info("engine serves weight_version %d; starting from it", reported)
            self.version = self.latest_version = reported
            self.metrics.version.set(reported)
            self.metrics.latest_version.set(reported)

    async def run(self) -> None:
        """Load offered versions until cancelled; a load that fails for good raises (the
        worker cannot go on without knowing its weights)."""
        while True:
            await self._swap(*await self._offers.take())

    async def _swap(self, version: int, state_dict: Mapping[str, Any]) -> None:
        self._gate.clear()
        self.swaps += 1
        try:
            if self.policy != "finish" and self.inflight_rids:
                await self.abort(list(self.inflight_rids))
            await self._idle.wait()
            backoff = 1.0
            while True:
                try:
                    await self.backend.load_version(version, state_dict)
                    break
                except EngineUnavailable as exc:
                    self.metrics.engine_errors.inc()
                    logger.warning("engine unavailable while loading v%d (%s)", version, exc)
                    if self.stop.requested.is_set():
                        return
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
            if version != self.version:
                self.applied.append(version)
            self.version = version
            self._loaded = (version, state_dict)
            self.metrics.version.set(version)
            self.metrics.version_lag.set(self.latest_version - version)
            logger.info("now generating with version %d (policy %s)", version, self.policy)
        finally:
            self._gate.set()

    # --- engine calls --------------------------------------------------------------------

    def open_gate(self) -> None:
        """Wake every call waiting for a version change (the worker is stopping)."""
        self._gate.set()

    async def call(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        rids: list[str],
        on_tokens: TokenProgress | None = None,
    ) -> tuple[list[GenerateOutput], int, int]:
        """One engine call, admitted by the version gate; returns the outputs with the
        version and swap counter in force when it was issued. ``on_tokens``: streamed
        (``Backend.generate``)."""
        while not self._gate.is_set():
            await self._gate.wait()
        if self.stop.cancelled.is_set():
            raise Stopped
        version, swaps = self.version, self.swaps
        self._inflight_calls += 1
        self._idle.clear()
        self.inflight_rids.update(rids)
        try:
            if on_tokens is None:
                outputs = await self.backend.generate(prompts, sampling, rids)
            else:
                outputs = await self.backend.generate(prompts, sampling, rids, on_tokens=on_tokens)
        finally:
            self._inflight_calls -= 1
            self.inflight_rids.difference_update(rids)
            if self._inflight_calls == 0:
                self._idle.set()
        return outputs, version, swaps

    async def abort(self, rids: list[str]) -> None:
        try:
            await self.backend.abort(rids)
        except EngineError as exc:  # the calls then finish on their own
            logger.warning("could not abort %d request(s): %s", len(rids), exc)

    def abort_inflight(self) -> asyncio.Future | None:
        """Abort every call in flight (in the background); None when there is none."""
        if not self.inflight_rids:
            return None
        return asyncio.ensure_future(self.abort(list(self.inflight_rids)))

    def segment_version(self, out: GenerateOutput, believed: int) -> int:
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
        stream judges their staleness), and the reload goes through ``run`` like any
        swap, so no engine call straddles it.
        """
        loaded = self._loaded
        if loaded is None or loaded[0] != believed or reported >= believed:
            return False
        if self._offers.empty:
            logger.warning(
                "engine reports weight_version %d but was given %d (restarted?): reloading %d",
                reported,
                believed,
                believed,
            )
            self._offers.put(*loaded)
        return True


# --- the weight follower -------------------------------------------------------------------


class VersionTarget(Protocol):
    """What a follower feeds: the worker, or a peer policy's engine."""

    def submit_version(self, version: int, state_dict: Mapping[str, Any]) -> None: ...


class WatchedListener:
    """An ``AnnouncementListener`` that remembers the newest announcement it has seen, so
    the worker knows how far behind it is even while the weight store is unreachable, and
    the trainer's trained version and pace for its credit.

    Only a newer version replaces the announcement held, and one whose pace was not
    believed (``Trust.vouched`` cleared it) keeps the pace last believed: a replay can
    neither lift the credit limit nor change it."""

    def __init__(self, listener: Any) -> None:
        self.listener = listener
        self.newest: int | None = None
        self.latest: VersionAnnouncement | None = None

    def next(self, timeout_s: float) -> Any:
        announcement = self.listener.next(timeout_s)
        if announcement is not None:
            self.newest = max(self.newest or 0, announcement.version)
            held = self.latest
            if held is None:
                self.latest = announcement
            elif announcement.version > held.version:
                self.latest = (
                    announcement if announcement.has_pace else _with_pace(announcement, held)
                )
        return announcement

    def close(self) -> None:
        self.listener.close()


def _with_pace(announcement: VersionAnnouncement, of: VersionAnnouncement) -> VersionAnnouncement:
    return replace(
        announcement,
        groups_per_step=of.groups_per_step,
        max_staleness=of.max_staleness,
        producers=of.producers,
    )


@dataclass
class Follower:
    """A running ``WeightFollower`` thread and the announcements it reads."""

    thread: threading.Thread
    listener: WatchedListener

    async def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the thread (its stop event set) off the loop."""
        await asyncio.to_thread(self.thread.join, timeout_s)


def start_follower(config: SharedConfig, target: VersionTarget, stop: threading.Event) -> Follower:
    """A ``WeightFollower`` thread feeding verified versions to ``target.submit_version``
    until ``stop`` is set; the caller closes ``listener`` once the thread is joined."""
    from weights.announce import AnnouncementListener
    from weights.follower import Snapshot, WeightFollower
    from weights.store import WeightStore
    from weights.trust import Trust

    def on_version(snapshot: Snapshot) -> None:
        target.submit_version(snapshot.version, snapshot.state)

    store = WeightStore.from_config(config.s3, config.run_id, config.policy)
    follower = WeightFollower.from_config(store, config.weights, on_version)
    # an announcement counts (credit, lag) only once the store holds its signed manifest,
    # and its pace only if it is signed itself
    trust = Trust.from_config(config.weights)
    listener = WatchedListener(
        AnnouncementListener(
            config.kafka.client_config(),
            config.run_id,
            config.weights.topic,
            confirm=trust.announcement_check(store),
            vouch=trust.vouched,
        )
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
    return Follower(thread, listener)
