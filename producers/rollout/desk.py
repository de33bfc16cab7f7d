"""The desk a worker plays its groups through when agents, not the worker, generate them.

``rollstream gateway`` hands each group to agents calling an OpenAI-compatible API; the
worker only offers the group, waits for what the agents made and publishes it. It sees the
gateway through this protocol, so the worker does not depend on the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from producers.rollout.episodes import EpisodeResult
from producers.rollout.versions import StopSignals
from producers.tasks.base import Prompt


@dataclass
class GroupOutcome:
    """What a group's agents made: the records to publish, the closed episodes they come
    from (the desk's own objects, handed back to ``Desk.settle``) and the abandoned
    episodes; ``stopped``: the producer stopped before every episode ended."""

    records: list[tuple[Prompt, EpisodeResult]]
    abandoned: dict[str, str]  # episode id -> why
    closed: list[Any] = field(default_factory=list)
    stopped: bool = False


class Desk(Protocol):
    """Where the worker's groups are played by someone else (the gateway's agents)."""

    stopping: bool
    """Set when the producer stops: no new episode is handed out."""

    async def play(
        self, prompt: Prompt, group_id: str, size: int, stop: StopSignals
    ) -> GroupOutcome:
        """Offer ``size`` episodes of ``prompt`` and wait until each is closed or abandoned
        (or the worker cancels: ``Stopped`` when none closed)."""
        ...

    def settle(self, outcome: GroupOutcome, fate: str) -> None:
        """What the worker did with the group's closed episodes (``publishing`` or
        ``dead_lettering``)."""
        ...
