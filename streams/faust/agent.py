"""What the stream worker's agent does with each message, apart from Faust's app.

``Assembler.handle`` is the agent's body for one message: admit it past the gap guard, run
its step (the processor decides; the old logits of closing groups are computed in a
one-thread executor, never on the event loop, so heartbeats and commits go on), and apply
the step atomically (``streams.faust.txn``). A bug processing one message dead-letters it; a
group whose old logits fail is failed alone. ``wait_for_versions`` holds the agent back
until the trainer's version is known. ``streams.faust.worker`` wires these to Faust.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import KW_ONLY, dataclass
from typing import Any

from schemas.trajectory import Trajectory
from streams.faust.gaps import GapGuard
from streams.faust.txn import EffectWriter
from streams.oldlogits import OldLogitEngine
from streams.processor import Message, Processor, Step
from streams.versions import VersionReader, VersionVoucher

log = logging.getLogger("streams")  # the worker's logger, whichever module logs


def now_ms() -> int:
    """Wall-clock milliseconds: the processor's notion of now (group timeouts)."""
    return int(time.time() * 1000)


def kafka_headers(headers: object) -> list[tuple[str, bytes]]:
    """Faust's headers (a mapping, a list of pairs, or None) as ``(name, bytes)`` pairs."""
    if headers is None:
        return []
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return [(str(k), bytes(v) if v is not None else b"") for k, v in pairs]  # type: ignore[union-attr]


def message_of(event: Any) -> Message:
    """The client-independent ``Message`` of a Faust event (``streams.processor``)."""
    message = event.message
    return Message(
        message.topic,
        message.partition,
        message.offset,
        event.key,
        event.value,
        tuple(kafka_headers(message.headers)),
    )


async def wait_for_versions(
    versions: VersionReader, warn_every_s: float = 60.0, poll_s: float = 0.05
) -> None:
    """Judge no record before the trainer's version is known (see streams.versions):
    wait, however long the version topic stays unreadable, and say so now and then.
    Going on without it would judge staleness against no version at all."""
    versions.start()
    waited_since = last_warning = time.monotonic()
    while not versions.caught_up.is_set():
        if time.monotonic() - last_warning > warn_every_s:
            last_warning = time.monotonic()
            log.warning(
                "%s not read to its end after %.0fs; no record is judged until it is",
                versions.topic,
                last_warning - waited_since,
            )
        await asyncio.sleep(poll_s)


@dataclass
class Assembler:
    """The agent's work per message: admit, decide, compute old logits off-loop, apply.

    ``executor``: where old logits are computed (one thread: the forward passes share the
    cores ``old_logits.torch_threads`` gives them). ``voucher``: asked about a record's
    version that no announcement has reached yet (None: such records are
    ``future_version``)."""

    processor: Processor
    engine: OldLogitEngine
    gaps: GapGuard
    writer: EffectWriter
    executor: Executor
    _: KW_ONLY
    clock: Callable[[], int] = now_ms
    voucher: VersionVoucher | None = None

    async def handle(self, msg: Message) -> None:
        """Process ``msg`` unless the gap guard drops it (records before it were skipped
        upstream and are being re-read); a step that raises is dead-lettered."""
        epoch = self.writer.epoch  # a rebalance before it is applied drops the step
        with self.gaps.busy():
            if not await self.gaps.admit(msg):
                return
            try:
                step = await self.step(msg)
            except Exception as err:  # a bug must not kill the worker: dead-letter it
                log.exception("processing %s-%d@%d failed", msg.topic, msg.partition, msg.offset)
                step = self.processor.failed(msg, err)
            await self.writer.apply(step, commit=self.gaps.rereading(msg), epoch=epoch)

    async def vouch_for(self, msg: Message) -> None:
        """Before a record claiming an unannounced version is judged, ask the weight store
        whether that version was published (off the event loop: a store read)."""
        claimed = self.processor.unannounced_version(msg)
        if claimed is None or self.voucher is None:
            return
        if await asyncio.to_thread(self.voucher.vouches, claimed):
            if claimed > self.processor.tracker.vouched:
                log.info("v%d is in the weight store ahead of its announcement", claimed)
            self.processor.tracker.vouch(claimed)

    async def step(self, msg: Message) -> Step:
        """A group whose old logits fail is failed alone (every sample dead-lettered by
        ``Processor.finish``); the other groups closed by the same message go on."""
        await self.vouch_for(msg)
        step = self.processor.handle(msg, self.clock())
        attached: dict[str, list[Trajectory]] = {}
        failed: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        for closing in step.closings:
            if closing.emit:
                group_id = closing.state.group_id
                try:
                    attached[group_id] = await loop.run_in_executor(
                        self.executor, self.engine.attach, closing.samples
                    )
                except Exception as err:
                    log.exception("old logits of group %s failed", group_id)
                    failed[group_id] = f"old logits: {type(err).__name__}: {err}"
        return self.processor.finish(step, attached, self.clock(), failed)
