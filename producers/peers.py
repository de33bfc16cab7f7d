"""Peer policies: the other policies a producer's episodes call, each on its own engine.

In a multi-policy run one producer drives an episode (its own policy's turns go through
the ``RolloutWorker``'s engine), and the episode may hand turns to other policies of the
run, its *peers*: a solver answering a proposer's problem, the other agent of a game.
Each peer has its own engine here, kept at its own policy's newest version by its own
weight follower (``weights/<run>/<peer>/``), and its own admission credit against its own
trainer's announcements (``producers.credit``): a peer whose trainer falls behind pauses
the producer as its own trainer would.

A peer's version changes only between its calls (the ``finish`` version policy): a swap
waits for the calls in flight and holds new ones back, so every peer turn was generated
under one known version. The engine's own ``weight_version`` tags the turn when it
reports one.

What a peer generated becomes records of the peer's policy (``PeerSample``), published
by the worker to that policy's raw topic as a group of their own; the peer's trainer
trains them, never the driver's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from producers.backends import Backend
from producers.client import EngineUnavailable, GenerateOutput
from producers.config import SamplingConfig
from producers.credit import AdmissionCredit
from schemas.control import VersionAnnouncement
from schemas.trajectory import NO_VERSION

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerTurn:
    """One turn a peer policy generated, tagged with the peer's version."""

    policy: str
    version: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_type: str
    finished_at_ms: int


@dataclass(frozen=True)
class PeerSample:
    """A peer's turn with its reward: one sample of the peer policy's own group."""

    turn: PeerTurn
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


class PeerEngine:
    """One peer policy's engine, its versions and its credit, inside a producer."""

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
        self._pending: tuple[int, Mapping[str, Any]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = asyncio.Event()
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
        newest = max(self.version, self._pending[0] if self._pending else NO_VERSION)
        if version <= newest:
            return
        self._pending = (version, state_dict)
        self._ready.set()

    async def run_versions(self) -> None:
        """Apply offered versions until cancelled (a task of the worker's loop)."""
        self._loop = asyncio.get_running_loop()
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._pending is None:
                continue
            version, state = self._pending
            self._pending = None
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
