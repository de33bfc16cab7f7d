"""A streamed call's text sent as the engine draws its tokens.

The engine's side (``on_tokens``, from ``GroupGenerator.turn``) only keeps the newest
tokens and wakes a writer task, which renders what they add as the API's events and writes
them: a slow client gets several tokens an event, and never holds the engine's side up.
A client that leaves is noticed (``left``), not raised: generation goes on, and the call
ends as one whose client left before its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

Render = Callable[[list[int], list[float]], list[bytes]]
"""The events the tokens so far add to what was sent (``TextStream`` behind it)."""


class Relay:
    """Writes ``render``'s events to ``response`` while a turn is generated; ``close``
    once it is."""

    def __init__(self, response: web.StreamResponse, render: Render) -> None:
        self.response = response
        self.render = render
        self.left = False
        self._latest: tuple[list[int], list[float]] | None = None
        self._arrived = asyncio.Event()
        self._closing = False
        self._task = asyncio.ensure_future(self._write())

    def on_tokens(self, ids: list[int], logprobs: list[float]) -> None:
        """The engine's side: the turn's tokens so far."""
        self._latest = (ids, logprobs)
        self._arrived.set()

    async def _write(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            latest, self._latest = self._latest, None
            if latest is not None:
                events = self.render(*latest)
                if events and not self.left:
                    try:
                        await self.response.write(b"".join(events))
                    except ConnectionError:
                        self.left = True
            if self._closing:
                return

    async def close(self) -> None:
        """Write what arrived last, then stop (never mid-event)."""
        self._closing = True
        self._arrived.set()
        await self._task
