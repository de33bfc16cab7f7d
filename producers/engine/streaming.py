"""A request's tokens as the engine draws them, handed from its scheduler thread to an
event loop: what ``/generate`` with ``"stream": true`` sends and the in-process backend
reports while a turn is generated (``producers.engine.server``, ``producers.engine.backends``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

TokenProgress = Callable[[list[int], list[float]], None]
"""Told of a request's output ids and their log-probs so far, each time there are more."""


class TokenFeed:
    """A request's ``on_token`` listener: the scheduler thread appends each token, and wakes
    the loop once until the loop has read what arrived (a slow reader gets several tokens
    at a time, never a wake-up per token it has not read)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self._arrived = asyncio.Event()
        self._woken = False

    def __call__(self, token: int, logprob: float) -> None:
        """The scheduler thread's side."""
        self.ids.append(token)
        self.logprobs.append(logprob)  # appended last: a reader counts these
        if not self._woken:
            self._woken = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads
                self.loop.call_soon_threadsafe(self._arrived.set)

    async def updates(self, future: Future) -> AsyncIterator[tuple[list[int], list[float]]]:
        """The ids and log-probs so far, each time more arrived, while ``future`` (the
        request's) is not done; its result holds them all, the last ones included."""
        done = asyncio.wrap_future(future)
        done.add_done_callback(lambda _: self._arrived.set())  # one wake-up for both
        sent = 0
        try:
            while not done.done():
                await self._arrived.wait()
                if done.done():
                    return  # the result holds every token
                self._arrived.clear()
                self._woken = False  # before counting: a token appended now wakes us again
                count = len(self.logprobs)
                if count > sent:
                    sent = count
                    yield self.ids[:count], self.logprobs[:count]
        finally:
            if done.done() and not done.cancelled():
                done.exception()  # the caller reads the outcome from ``future`` itself
