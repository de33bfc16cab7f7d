"""Peer policies: the other policies a producer's episodes call, each on its own engine.

In a multi-policy run one producer drives an episode (its own policy's turns go through
the ``RolloutWorker``'s engine), and the episode may hand turns to other policies of the
run, its *peers*: a solver answering a proposer's problem, the other agent of a game.
Each peer has its own engine here, kept at its own policy's newest version by its own
weight follower (``weights/<run>/<peer>/``), and its own admission credit against its own
trainer's announcements (``producers.rollout.credit``): a peer whose trainer falls behind pauses
the producer as its own trainer would.

A peer's version changes only between its calls (the ``finish`` version policy): a swap
waits for the calls in flight and holds new ones back, so every peer turn was generated
under one known version. The engine's own ``weight_version`` tags the turn when it
reports one.

What a peer generated becomes records of the peer's policy (``PeerSample``), published
by the worker to that policy's raw topic as a group of their own; the peer's trainer
trains them, never the driver's. ``PeerSide`` holds what a producer opens for its peers
(engines, ledgers, publishers, followers, heartbeats) and closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from core.config import RoleConfig, SharedConfig
from producers.config import ProducersConfig
from producers.engine.backends import Backend, http_backend, local_backend
from producers.engine.client import EngineUnavailable, GenerateOutput
from producers.engine.config import SamplingConfig
from producers.rollout.credit import AdmissionCredit
from producers.rollout.group_publisher import GroupPublisher, recovered_publisher
from producers.rollout.ledger import Ledger, StopRecord, ledger_dir
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.versions import OfferedWeights, WatchedListener, start_follower
from producers.tasks.peers import PeerTurn
from schemas.control import VersionAnnouncement
from schemas.trajectory import NO_VERSION

logger = logging.getLogger(__name__)


class PeerEngine:
    """One peer policy's engine, its versions and its credit, inside a producer (the
    ``PeerCall`` a game is given)."""

    def __init__(
        self,
        policy: str,
        backend: Backend,
        sampling: SamplingConfig,
        *,
        staleness_window: int,
        groups_per_version: float | None = None,
        announcement: Callable[[], VersionAnnouncement | None] | None = None,
        wait_for_first_version: bool = True,
        initial_version: int = 0,
    ) -> None:
        self.policy = policy
        self.backend = backend
        self.sampling = sampling
        self.staleness_window = staleness_window
        self.announcement = announcement
        self.credit = AdmissionCredit(groups_per_version)
        self.version = NO_VERSION if wait_for_first_version else initial_version
        self.turns = 0
        self._offers = OfferedWeights()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0
        self._failure: BaseException | None = None
        self._away: EngineUnavailable | None = None  # the engine is away while loading

    # --- versions ----------------------------------------------------------------------------

    def submit_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Offer new weights from any thread (the peer's ``WeightFollower``)."""
        if self._loop is None:
            raise RuntimeError(f"peer {self.policy!r} is not running")
        self._loop.call_soon_threadsafe(self._offer, version, state_dict)

    def _offer(self, version: int, state_dict: Mapping[str, Any]) -> None:
        if version > self._offers.newest(self.version):
            self._offers.put(version, state_dict)

    async def run_versions(self) -> None:
        """Apply offered versions until cancelled (a task of the worker's loop)."""
        self._loop = asyncio.get_running_loop()
        while True:
            version, state = await self._offers.take()
            self._gate.clear()
            try:
                await self._idle.wait()
                await self._load(version, state)
                self.version = version
                logger.info("peer %s now generates with version %d", self.policy, version)
            except Exception as exc:  # a peer that cannot load its weights stops the worker
                self._failure = exc
                raise
            finally:
                self._gate.set()

    async def _load(self, version: int, state: Mapping[str, Any]) -> None:
        """Load ``version``, riding out an engine that is away (retried with back-off, as
        the worker's own engine is); any other refusal is final."""
        backoff = 1.0
        try:
            while True:
                try:
                    await self.backend.load_version(version, state)
                    return
                except EngineUnavailable as exc:
                    self._away = exc  # calls waiting for the load fail fast meanwhile
                    logger.warning(
                        "peer %s: engine unavailable loading v%d (%s)", self.policy, version, exc
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
        finally:
            self._away = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Accept ``submit_version`` calls for ``loop`` before ``run_versions`` starts."""
        self._loop = loop

    # --- admission -----------------------------------------------------------------------------

    def pause_reason(self) -> str | None:
        """Why no new group that calls this peer may start now, or None."""
        if self._failure is not None:
            raise self._failure
        if self.version == NO_VERSION:
            return f"waiting for peer policy {self.policy!r}'s first version"
        trainer = self.announcement() if self.announcement is not None else None
        window = self.staleness_window
        if trainer is not None and trainer.max_staleness is not None:
            window = min(window, trainer.max_staleness)
        if trainer is not None and trainer.version - self.version > window:
            return (
                f"peer {self.policy!r} serves v{self.version} but v{trainer.version} is "
                f"announced, more than its staleness window ({window}) behind"
            )
        why = self.credit.pause(trainer, window, self.version)
        return None if why is None else f"peer {self.policy!r}: {why}"

    def started(self) -> None:
        """A group that calls this peer started (its credit is charged)."""
        self.credit.started()

    def refund(self) -> None:
        """A started group made no group of this peer's: its charge comes back."""
        self.credit.refund()

    # --- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        rid: str | None = None,
    ) -> PeerTurn:
        """One turn of the peer from ``prompt_ids``, under one version."""
        while not self._gate.is_set():
            if self._away is not None:  # the group is generated again later, not scored
                raise EngineUnavailable(f"peer {self.policy!r}: {self._away}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gate.wait(), 0.5)
        believed = self.version
        self._inflight += 1
        self._idle.clear()
        params = self.sampling.to_sglang(max_new_tokens, list(stop_token_ids))
        self.turns += 1
        try:
            (out,) = await self.backend.generate(
                [list(prompt_ids)], [params], [rid or f"peer-{self.policy}-{uuid.uuid4().hex}"]
            )
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        return PeerTurn(
            policy=self.policy,
            version=_reported_version(out, believed),
            prompt_ids=list(prompt_ids),
            response_ids=list(out.output_ids),
            logprobs=list(out.logprobs or []),
            finish_type=out.finish_type,
            finished_at_ms=int(time.time() * 1000),
        )


def _reported_version(out: GenerateOutput, believed: int) -> int:
    """The engine's integer ``weight_version`` if it reports one, else our belief."""
    try:
        return int(out.weight_version) if out.weight_version is not None else believed
    except ValueError:
        return believed


@dataclass
class Peers:
    """The peer policies a task's episodes may call, by policy name."""

    engines: dict[str, PeerEngine] = field(default_factory=dict)

    def __getitem__(self, policy: str) -> PeerEngine:
        if policy not in self.engines:
            known = ", ".join(sorted(self.engines)) or "none"
            raise KeyError(f"no peer policy {policy!r} in this producer (peers: {known})")
        return self.engines[policy]

    def __contains__(self, policy: object) -> bool:
        return policy in self.engines

    def __bool__(self) -> bool:
        return bool(self.engines)


class PeerSide:
    """What a producer holds for its peer policies: per peer an engine (in-process, or
    the peer's ``rollout.engine_url``), a ledger and publisher on the peer's raw topic, a
    weight follower on the peer's lineage, and a heartbeat on the peer's roles topic.

    Each is registered for closing as it is opened; ``close`` (or leaving the ``async
    with``) releases them in reverse, each step on its own: one that fails is logged and
    the others still run."""

    def __init__(
        self,
        config: SharedConfig,
        producer_id: str,
        metrics: ProducerMetrics,
        stop: threading.Event | None,
    ) -> None:
        self.config = config
        self.producer_id = producer_id
        self.metrics = metrics
        # stops the peers' weight followers (the driver's own, when it shares it)
        self.stop = stop if stop is not None else threading.Event()
        self.peers = Peers()
        self.publishers: dict[str, GroupPublisher] = {}
        self.configs: dict[str, RoleConfig[ProducersConfig]] = {}
        self.watchers: dict[str, WatchedListener] = {}
        self._closing = contextlib.AsyncExitStack()

    async def __aenter__(self) -> PeerSide:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _on_close(self, what: str, step: Callable[[], Any]) -> None:
        async def run() -> None:
            try:
                done = step()
                if asyncio.iscoroutine(done) or isinstance(done, asyncio.Future):
                    await done
            except Exception as exc:
                logger.warning("closing the peers: %s failed: %r", what, exc)

        self._closing.push_async_callback(run)

    async def add(self, name: str, config: RoleConfig[ProducersConfig]) -> None:
        """Open peer policy ``name`` (what its producer role receives): engine, ledger
        (recovered), publisher."""
        peer, producers = config
        if peer.policy != name:
            raise ValueError(f"peer {name!r} was given the config of policy {peer.policy!r}")
        rollout = producers.rollout
        directory = ledger_dir(peer.state_dir, peer.run_id, self.producer_id, name)
        backend: Backend
        if rollout.engine_url:
            backend = await http_backend(
                rollout, producers.engine, directory / "weights", peer.cache_dir, peer.lora
            )
        else:
            backend = await local_backend(producers.engine, peer.cache_dir, rollout.initial_version)
        self._on_close(f"engine of {name}", backend.aclose)
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
        ledger = Ledger(directory, fsync=rollout.ledger_fsync).open()
        self._on_close(f"ledger {ledger.path}", ledger.close)
        # the peer's own counts: the served metrics are the driver's
        publisher = await recovered_publisher(client_config, rollout, ledger, ProducerMetrics())
        self._on_close(f"publisher of {name}", partial(asyncio.to_thread, publisher.close))
        self.publishers[name] = publisher
        self.configs[name] = config

    def start_following(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind each peer engine to ``loop`` and start its weight follower (when the
        peer follows weights)."""
        for name, (peer, producers) in self.configs.items():
            engine = self.peers[name]
            engine.bind(loop)
            if producers.rollout.follow_weights:
                follower = start_follower(peer, engine, self.stop)
                self._on_close(f"announcements of {name}", follower.listener.close)
                self._on_close(f"follower {follower.thread.name}", follower.join)
                self.watchers[name] = follower.listener

    def announce(self) -> None:
        """Heartbeats on each peer's roles topic: its trainer and ``rollstream roles``
        count this producer among the policy's producers."""
        from core.presence import Beacon

        for name, (peer, _) in self.configs.items():
            if peer.presence.enabled:
                beacon = Beacon(
                    peer.kafka.client_config(),
                    peer.presence.topic,
                    run=peer.run_id,
                    role="producer",
                    instance=self.producer_id,
                    interval_s=peer.presence.interval_s,
                    detail=self._detail(name),
                ).start()
                self._on_close(
                    f"heartbeat of {name}", partial(self._leave, beacon, self._detail(name))
                )

    @staticmethod
    def _leave(beacon: Any, detail: Callable[[], dict[str, Any]]) -> None:
        beacon.leave(detail())

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
        """Stop the peers' followers, then release everything in reverse order of
        opening (the driver's own resources are released after this)."""
        self.stop.set()
        await self._closing.aclose()
