"""What a task sees of the run's other policies: a peer it can call, and what the call made.

A game (``producers.tasks.games``) hands turns to a peer policy through ``PeerCall``; the
rollout worker implements it on the peer's own engine and publishes the ``PeerSample``s as
records of that peer's policy. Tasks never reach the worker itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


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


class PeerCall(Protocol):
    """One peer policy a task may call: ``generate`` makes one turn under one version."""

    @property
    def policy(self) -> str: ...

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        rid: str | None = None,
    ) -> PeerTurn: ...


class PeerCalls(Protocol):
    """The peer policies a task's episodes may call, by policy name (``TaskContext.peers``)."""

    def __getitem__(self, policy: str) -> PeerCall: ...

    def __contains__(self, policy: object) -> bool: ...
