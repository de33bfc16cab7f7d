"""Publishing groups to Kafka: idempotent producer, per-group delivery accounting, ledger.

``GroupPublisher.publish(group_id, trajectories)`` writes a ``pending`` ledger line (and
fsyncs it; ``publish_async`` does the fsync in a thread, off the event loop), then
produces the G records (key = group id, value = ``schemas.codec.encode``, headers =
``routing_headers``). Delivery callbacks run inside ``poll``/``flush`` (the caller's
thread); when the G-th acknowledgement of a group arrives, the group's ``delivered``
line goes to the ledger with every record's partition and offset. A group is delivered
only then. ``dead_letter`` sends a group's records to the dead-letter topic instead, each
with a ``DeadLetter`` header; their acknowledgement is the ledger's ``dead_lettered`` line.

The producer is idempotent (``enable.idempotence=true``, hence ``acks=all``): librdkafka
retries internally without duplicates or reordering for as long as
``delivery.timeout.ms`` allows, which is how a broker outage is ridden out. The first
delivery error (a record refused, a timeout, a fatal idempotence error) is kept and
raised as ``DeliveryError`` by the next ``publish``/``poll``/``flush``: never dropped.
When librdkafka's local queue is full, ``publish`` polls until there is room, so memory
stays bounded (``queue.buffering.max.*``) while the broker is away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from producers.config import RolloutConfig
from producers.rollout.ledger import Ledger, recover
from producers.rollout.metrics import ProducerMetrics
from schemas.codec import encode, routing_headers
from schemas.control import DeadLetter
from schemas.topics import ROLLOUTS_RAW, producer_limits
from schemas.trajectory import Trajectory

logger = logging.getLogger(__name__)


class DeliveryError(RuntimeError):
    """Kafka refused or timed out a record; carries the first ``KafkaError``."""

    def __init__(self, message: str, error: Any = None) -> None:
        super().__init__(message)
        self.error = error


@dataclass(frozen=True)
class _Prepared:
    group_id: str
    values: list[bytes]
    headers: list[list[tuple[str, bytes]]]
    topic: str = ""  # default: the publisher's


@dataclass
class _Group:
    trajectory_ids: list[str]
    positions: dict[int, tuple[int, int]] = field(default_factory=dict)
    failed: bool = False
    dead_letter: str = ""  # the reason, for a group sent to the dead-letter topic


def producer_config(
    client_config: Mapping[str, str],
    *,
    delivery_timeout_ms: int = 86_400_000,
    overrides: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """librdkafka settings of the rollout producer (idempotent, acks=all)."""
    conf: dict[str, Any] = {
        **client_config,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        # The stream workers' aiokafka reads every codec (cramjam is locked for lz4, zstd
        # and snappy; tests/system/infra/test_kafka_clients.py); gzip is what the pipeline
        # was measured with.
        "compression.type": "gzip",
        "delivery.timeout.ms": delivery_timeout_ms,
        "queue.buffering.max.messages": 100_000,
        "queue.buffering.max.kbytes": 262_144,  # 256 MiB of queued records at most
        **producer_limits(ROLLOUTS_RAW),
    }
    conf.update(overrides or {})
    if str(conf["enable.idempotence"]).lower() not in ("true", "1"):
        raise ValueError("the rollout producer must be idempotent (enable.idempotence=true)")
    return conf


class GroupPublisher:
    """Produces whole groups and tells when each is durably in the topic."""

    def __init__(
        self,
        client_config: Mapping[str, str],
        topic: str,
        ledger: Ledger,
        metrics: ProducerMetrics | None = None,
        *,
        delivery_timeout_ms: int = 86_400_000,
        overrides: Mapping[str, str] | None = None,
    ) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.client_config = dict(client_config)  # to read the topic's end offsets
        self.ledger = ledger
        self.metrics = metrics or ProducerMetrics()
        conf = producer_config(
            client_config, delivery_timeout_ms=delivery_timeout_ms, overrides=overrides
        )
        conf["error_cb"] = self._on_error
        self._producer = Producer(conf)
        self._groups: dict[str, _Group] = {}
        self._first_error: DeliveryError | None = None
        self._last_warning = 0.0
        self.delivered_groups = 0

    # --- producing ---------------------------------------------------------------------

    def publish(self, group_id: str, trajectories: Sequence[Trajectory]) -> None:
        """Produce a group's records (returns before they are acknowledged)."""
        prepared = self.prepare(group_id, trajectories)
        self.ledger.sync()
        self.send(prepared)

    async def publish_async(self, group_id: str, trajectories: Sequence[Trajectory]) -> None:
        """``publish`` with the ledger's fsync in a thread (``Ledger.synced``, shared with
        the lines written beside it): the event loop keeps serving other groups while the
        disk confirms the ``pending`` line."""
        prepared = self.prepare(group_id, trajectories)
        await self.ledger.synced()
        self.send(prepared)

    def prepare(self, group_id: str, trajectories: Sequence[Trajectory]) -> _Prepared:
        """Encode the records and write the group's ``pending`` ledger line (not synced)."""
        self.raise_if_failed()
        if group_id in self._groups:
            raise ValueError(f"group {group_id} is already being published")
        ids = [t.trajectory_id for t in trajectories]
        values = [encode(t) for t in trajectories]
        headers = [routing_headers(t) for t in trajectories]
        position = trajectories[0].reward_details.get("prompt_position") if trajectories else None
        self.ledger.pending(
            group_id,
            ids,
            sync=False,
            prompt_position=position if isinstance(position, int) else None,
        )
        self._groups[group_id] = _Group(ids)
        self.metrics.undelivered_groups.set(len(self._groups))
        return _Prepared(group_id, values, headers)

    def dead_letter(
        self,
        group_id: str,
        trajectories: Sequence[Trajectory],
        topic: str,
        reason: str,
        detail: str,
    ) -> None:
        """Produce a group's records to the dead-letter ``topic`` (never to the raw one),
        each with a ``DeadLetter`` header naming ``reason``; the ledger's ``dead_lettered``
        line follows their acknowledgement, as ``delivered`` does a group's."""
        self.raise_if_failed()
        if group_id in self._groups:
            raise ValueError(f"group {group_id} is already being published")
        letter = DeadLetter(reason, detail[:2000], self.topic, 0, 0).header()
        ids = [t.trajectory_id for t in trajectories]
        self._groups[group_id] = _Group(ids, dead_letter=reason)
        self.metrics.undelivered_groups.set(len(self._groups))
        values = [encode(t) for t in trajectories]
        headers = [[*routing_headers(t), letter] for t in trajectories]
        self.send(_Prepared(group_id, values, headers, topic))

    def send(self, prepared: _Prepared) -> None:
        """Hand a prepared group's records to the producer (after the ledger sync)."""
        key = prepared.group_id.encode()
        for index, (value, headers) in enumerate(
            zip(prepared.values, prepared.headers, strict=True)
        ):
            callback = partial(self._on_delivery, prepared.group_id, index)
            while True:
                try:
                    self._producer.produce(
                        prepared.topic or self.topic,
                        value=value,
                        key=key,
                        headers=headers,
                        on_delivery=callback,
                    )
                    break
                except BufferError:  # local queue full: wait for the broker to drain it
                    self._warn("producer queue full; waiting for Kafka to acknowledge records")
                    self._producer.poll(0.1)
                    self.raise_if_failed()
        # Delivery callbacks are served by the caller's regular poll() (the worker polls
        # every 10 ms), not here: publishing stays the cost of encoding and enqueueing.

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery callbacks; raises the first delivery error."""
        served = self._producer.poll(timeout)
        self.raise_if_failed()
        return served

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for every queued record; returns how many are still queued."""
        remaining = self._producer.flush(timeout)
        self.raise_if_failed()
        return remaining

    def close(self, timeout: float = 5.0) -> None:
        """Flush for up to ``timeout`` s, drop what is left (its groups stay ``pending``
        in the ledger for the next start's recovery), release the producer."""
        if self._producer.flush(timeout):
            logger.warning(
                "closing with %d group(s) unacknowledged: left to recovery", len(self._groups)
            )
            self._producer.purge()
            self._producer.poll(0)
        self._producer.close()

    @property
    def undelivered_groups(self) -> int:
        return len(self._groups)

    def raise_if_failed(self) -> None:
        if self._first_error is not None:
            raise self._first_error

    # --- callbacks ---------------------------------------------------------------------

    def _on_delivery(self, group_id: str, index: int, err: Any, msg: Any) -> None:
        group = self._groups.get(group_id)
        if group is None:
            return
        if err is not None:
            self.metrics.delivery_failures.inc()
            group.failed = True
            if self._first_error is None:
                self._first_error = DeliveryError(
                    f"delivery of {group.trajectory_ids[index]} (group {group_id}) to "
                    f"{self.topic} failed: {err}",
                    err,
                )
            return
        group.positions[index] = (msg.partition(), msg.offset())
        if len(group.positions) < len(group.trajectory_ids) or group.failed:
            return
        del self._groups[group_id]
        self.metrics.undelivered_groups.set(len(self._groups))
        if group.dead_letter:
            self.ledger.dead_lettered(group_id, group.trajectory_ids, group.dead_letter)
        else:
            positions = [group.positions[i] for i in range(len(group.trajectory_ids))]
            self.ledger.delivered(group_id, group.trajectory_ids, positions)
            self.delivered_groups += 1
            self.metrics.groups.inc()
            self.metrics.trajectories.inc(len(positions))

    def _on_error(self, err: Any) -> None:
        if err.fatal():
            if self._first_error is None:
                self._first_error = DeliveryError(f"fatal Kafka producer error: {err}", err)
            return
        self._warn(f"Kafka: {err} (records stay queued and are retried)")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            logger.warning("%s; %d group(s) await acknowledgement", message, len(self._groups))


async def recovered_publisher(
    client_config: Mapping[str, str],
    rollout: RolloutConfig,
    ledger: Ledger,
    metrics: ProducerMetrics,
) -> GroupPublisher:
    """A publisher on ``rollout.topic`` whose ledger is first reconciled with the topic:
    the groups a crash left pending resolved, the topic's end offsets marked (where a
    later recovery starts looking)."""
    from core.topic_reader import end_offsets

    await asyncio.to_thread(recover, ledger, client_config, rollout.topic)
    ledger.mark(await asyncio.to_thread(end_offsets, client_config, rollout.topic))
    return GroupPublisher(
        client_config,
        rollout.topic,
        ledger,
        metrics,
        delivery_timeout_ms=rollout.delivery_timeout_ms,
        overrides=rollout.producer_overrides,
    )
