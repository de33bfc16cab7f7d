"""Holding a real engine mid-generation, so a test sees what was streamed while the
generation is provably unfinished, whatever the machine's speed.

``StepGate(engine)`` lets the engine draw tokens until one of its running requests has
text (its tokens decode to something), then holds it before its next draw until
``open()`` (at once if it was opened already), or ``timeout_s`` (``timed_out``: a test
that never opens it fails on what it asserts, never hangs). ``held_at`` is how many tokens
the held request had drawn: whoever opened it had done so before any more were drawn.
"""

from __future__ import annotations

import threading
from typing import Any


class StepGate:
    def __init__(self, engine: Any, timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.opened = threading.Event()
        self.held_at: int | None = None
        self.timed_out = False
        self._step = engine._sample_step
        engine._sample_step = self._gated

    def _gated(self, live: list[Any], *args: Any) -> Any:
        if self.held_at is None:  # opened already or not: no further token before it is
            texts = [self.engine.decode(r.output_ids) for r in live]
            if any(texts):
                self.held_at = max(len(r.output_ids) for r in live)
                self.timed_out = not self.opened.wait(self.timeout_s)
        return self._step(live, *args)

    def open(self) -> None:
        self.opened.set()

    def remove(self) -> None:
        """The engine's own step again (and anything held goes on)."""
        self.engine._sample_step = self._step
        self.opened.set()
