"""The delivery ledger: what this producer knows it delivered, durable across kill -9.

An append-only JSONL file under ``<state_dir>/producers/<run_id>/<producer_id>/``,
one event a line, flushed to the OS as it is written (enough to survive kill -9):

- ``mark``: the end offsets of every partition of the topic, queried at start-up and
  then periodically. Any record produced after a mark lies at or beyond it.
- ``pending``: a group is about to be produced (its id and its G trajectory ids, and the
  position of its prompt in the task's epochs where the task walks a dataset in order).
- ``delivered``: all G records of the group are acknowledged by the broker, with their
  partitions and offsets. Only this line counts a group as delivered.
- ``orphaned`` / ``lost``: written by recovery for a group left pending by a crash: some
  (orphaned) or none (lost) of its records reached the topic. Neither counts as
  delivered; consumers drop incomplete groups anyway.
- ``stopped``: the producer stopped on request (SIGTERM, Ctrl-C): which groups that were
  in flight it finished and published, which it aborted (never published, so never
  trained), and which were published but left unacknowledged (recovery settles them).
  A producer killed with SIGKILL writes none; its ``pending`` groups say the rest.
- ``abandoned``: gateway episodes of a group that ended without a reward (the agent went
  away, never opened its slot, or the producer stopped), each with the reason; they are
  never published.
- ``episode_call``: one completed call of a gateway episode (group and episode ids, the
  call's number, its prompt and response token counts; not the tokens), written before
  the call's answer leaves the gateway. A producer killed mid-episode loses the episodes'
  tokens, but not the fact that they existed: on restart ``close_interrupted`` writes
  an ``abandoned`` line for each episode with committed calls whose group has no
  publish or abandon line (``GATEWAY_RESTARTED``).
- ``dead_lettered``: gateway episodes an agent closed whose group could not be published
  (the producer stopped with too few of it closed), acknowledged in the dead-letter topic
  with the reason: their trajectory ids, so ``rollstream audit`` expects them there.

Recovery (``recover``) runs at start-up, before producing. For each group left pending
it scans the topic from the last mark written before the oldest pending line (a bounded
tail) and looks for the group's trajectory ids in the ``rs-trajectory-id`` headers: all
G found means delivered (the crash hit between the acks and the ledger line), fewer
means orphaned. Afterwards the ledger's delivered ids are exactly the complete groups
this producer put in the topic, and its orphaned ids exactly the partial ones.

Only ``pending`` and ``episode_call`` lines are fsynced (``fsync=True``, the default): a
group's must be on disk before its records can reach Kafka, or a power cut could leave
records the ledger never heard of; a call's before its answer leaves. A lost
``delivered`` line is harmless (recovery finds the group in the topic), a lost ``mark``
only makes recovery scan from an older one. A torn last line (a crash mid-write) is cut
off when the ledger is opened; any other malformed line is refused when it is read. Lines
written on the event loop are fsynced in a thread (``synced``): concurrent callers share
one fsync that began after their lines were written (a group commit), so a burst of calls
costs one thread hop and one fsync. An advisory lock (``flock``) keeps two processes from
sharing one ledger.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from core.topic_reader import end_offsets
from schemas.codec import TRAJECTORY_ID_HEADER

logger = logging.getLogger(__name__)

LEDGER_NAME = "ledger.jsonl"

GATEWAY_RESTARTED = "the gateway restarted"
"""Why a gateway episode with committed calls, open when its producer died, ended."""


class LedgerLocked(RuntimeError):
    """Another process holds this ledger."""


@dataclass
class PendingGroup:
    group_id: str
    trajectory_ids: list[str]
    line: int  # index of its pending line among all lines


@dataclass(frozen=True)
class CallCounts:
    """A completed gateway call: its number in the episode (from 1) and its size."""

    number: int
    prompt_tokens: int
    response_tokens: int


@dataclass(frozen=True)
class StopRecord:
    """What a producer did with its groups in flight when asked to stop."""

    policy: str  # "abort" or "finish" (producers.rollout.stop_policy)
    finished: list[str]  # in flight at the request, then published
    aborted: list[str]  # in flight at the request, dropped unpublished
    unacknowledged: list[str]  # published, not acknowledged when the producer left
    ts_ms: int = 0


@dataclass
class LedgerState:
    """What the ledger's lines say, folded."""

    delivered: dict[str, list[str]] = field(default_factory=dict)
    orphaned: dict[str, list[str]] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    pending: dict[str, PendingGroup] = field(default_factory=dict)
    marks: list[tuple[int, dict[int, int]]] = field(default_factory=list)  # (line, offsets)
    stops: list[StopRecord] = field(default_factory=list)
    lines: int = 0
    positions: dict[str, int] = field(default_factory=dict)  # group -> prompt position
    abandoned: dict[str, dict[str, str]] = field(default_factory=dict)  # group -> episode -> why
    dead_lettered: dict[str, list[str]] = field(default_factory=dict)  # group -> ids in the DLQ
    episode_calls: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # group -> episode -> calls

    @property
    def delivered_ids(self) -> set[str]:
        return {tid for ids in self.delivered.values() for tid in ids}

    @property
    def abandoned_episodes(self) -> dict[str, str]:
        """Every abandoned episode's reason, by episode id."""
        return {eid: why for reasons in self.abandoned.values() for eid, why in reasons.items()}

    def interrupted(self) -> dict[str, dict[str, int]]:
        """Gateway episodes with committed calls that nothing settled: their group has no
        ``pending``, ``delivered``, ``orphaned``, ``lost`` or ``dead_lettered`` line and
        they no ``abandoned`` one (group -> episode -> calls)."""
        settled = self.delivered.keys() | self.orphaned.keys() | self.lost | self.pending.keys()
        settled |= self.dead_lettered.keys()
        open_ = {}
        for gid, episodes in self.episode_calls.items():
            if gid in settled:
                continue
            ended = self.abandoned.get(gid, {})
            left = {eid: n for eid, n in episodes.items() if eid not in ended}
            if left:
                open_[gid] = left
        return open_

    @property
    def delivered_positions(self) -> set[int]:
        """The prompt positions of the delivered groups: what a task walking its dataset
        in epochs must not give again after a restart."""
        return {self.positions[gid] for gid in self.delivered if gid in self.positions}


class Ledger:
    """The ledger file of one producer; ``open`` it, then ``close`` it (or ``with``)."""

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LEDGER_NAME
        self.fsync = fsync
        self.state = LedgerState()
        self._fh: Any = None
        self._lock_fh: Any = None
        self._synced_lines = 0  # every line before it is on disk
        self._syncing: asyncio.Future[None] | None = None

    def open(self) -> Ledger:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fh = (self.directory / ".lock").open("w")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            self._lock_fh.close()
            raise LedgerLocked(
                f"ledger {self.path} is in use by another process: give each worker its own "
                "rollout.producer_id"
            ) from exc
        self._repair_tail()
        self.state = read_ledger(self.path)
        self._fh = self.path.open("ab")
        return self

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    def __enter__(self) -> Ledger:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _repair_tail(self) -> None:
        """Cut a torn last line (a crash mid-write) so appends start on a line boundary."""
        if not self.path.exists():
            return
        with self.path.open("r+b") as fh:
            data = fh.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                logger.warning(
                    "ledger %s: dropping a torn last line (%d bytes)", self.path, len(data) - keep
                )
                fh.truncate(keep)

    # --- events ------------------------------------------------------------------------

    def mark(self, offsets: Mapping[int, int]) -> None:
        self._append({"kind": "mark", "offsets": {str(p): o for p, o in offsets.items()}})
        self.state.marks.append((self.state.lines - 1, dict(offsets)))

    def pending(
        self,
        group_id: str,
        trajectory_ids: list[str],
        *,
        sync: bool = True,
        prompt_position: int | None = None,
    ) -> None:
        """Record a group about to be produced; with ``sync=False`` the caller must call
        ``sync()`` before producing (e.g. from another thread, off the event loop)."""
        event: dict[str, Any] = {
            "kind": "pending",
            "group_id": group_id,
            "trajectory_ids": trajectory_ids,
        }
        if prompt_position is not None:
            event["prompt_position"] = prompt_position
            self.state.positions[group_id] = prompt_position
        self._append(event, sync=sync)
        self.state.pending[group_id] = PendingGroup(group_id, trajectory_ids, self.state.lines - 1)

    def sync(self) -> None:
        """fsync what was written (when ``fsync``); safe to call from another thread."""
        if self.fsync and self._fh is not None:
            os.fsync(self._fh.fileno())

    async def synced(self) -> None:
        """Return once every line written so far is on disk (when ``fsync``), the fsync in
        a thread; an fsync already running when a line was written does not count for it,
        the next one, shared with the other callers waiting, does."""
        if not self.fsync:
            return
        target = self.state.lines
        loop = asyncio.get_running_loop()
        while self._synced_lines < target:
            if self._syncing is None or self._syncing.get_loop() is not loop:
                self._syncing = asyncio.ensure_future(self._sync_once())
            await asyncio.shield(self._syncing)

    async def _sync_once(self) -> None:
        upto = self.state.lines  # written (flushed to the OS) before the fsync starts
        try:
            await asyncio.to_thread(self.sync)
            self._synced_lines = max(self._synced_lines, upto)
        finally:
            self._syncing = None

    def delivered(
        self,
        group_id: str,
        trajectory_ids: list[str],
        positions: list[tuple[int, int]],
        *,
        recovered: bool = False,
    ) -> None:
        event = {
            "kind": "delivered",
            "group_id": group_id,
            "trajectory_ids": trajectory_ids,
            "positions": positions,
        }
        if recovered:
            event["recovered"] = True
        self._append(event)
        self.state.pending.pop(group_id, None)
        self.state.delivered[group_id] = trajectory_ids

    def orphaned(self, group_id: str, found: list[str], positions: list[tuple[int, int]]) -> None:
        event = {"kind": "orphaned", "group_id": group_id, "trajectory_ids": found}
        self._append({**event, "positions": positions})
        self.state.pending.pop(group_id, None)
        self.state.orphaned[group_id] = found

    def lost(self, group_id: str) -> None:
        self._append({"kind": "lost", "group_id": group_id})
        self.state.pending.pop(group_id, None)
        self.state.lost.add(group_id)

    def stopped(self, record: StopRecord) -> None:
        """The last line of a producer that stopped on request."""
        event = {
            "kind": "stopped",
            "policy": record.policy,
            "finished": record.finished,
            "aborted": record.aborted,
            "unacknowledged": record.unacknowledged,
        }
        self._append(event, sync=True)
        self.state.stops.append(record)

    def abandoned(self, group_id: str, reasons: Mapping[str, str]) -> None:
        """Episodes of ``group_id`` (by episode id) that will not be published, and why."""
        self._append({"kind": "abandoned", "group_id": group_id, "episodes": dict(reasons)})
        self.state.abandoned.setdefault(group_id, {}).update(reasons)

    def episode_call(
        self, group_id: str, episode_id: str, call: CallCounts, *, sync: bool = True
    ) -> None:
        """A completed gateway call of ``episode_id``, before its answer is returned; with
        ``sync=False`` the caller must call ``sync()`` before answering."""
        event = {
            "kind": "episode_call",
            "group_id": group_id,
            "episode_id": episode_id,
            "call": call.number,
            "prompt_tokens": call.prompt_tokens,
            "response_tokens": call.response_tokens,
        }
        self._append(event, sync=sync)
        self.state.episode_calls.setdefault(group_id, {})[episode_id] = call.number

    def close_interrupted(self) -> dict[str, str]:
        """At start-up: abandon the gateway episodes a killed producer left with committed
        calls (``LedgerState.interrupted``), one ``abandoned`` line per group; a group a
        ``stopped`` line aborted says the producer stopped. Returns episode id -> why."""
        aborted = {gid for stop in self.state.stops for gid in stop.aborted}
        closed: dict[str, str] = {}
        for gid, episodes in self.state.interrupted().items():
            why = "the producer stopped" if gid in aborted else GATEWAY_RESTARTED
            self.abandoned(gid, dict.fromkeys(episodes, why))
            closed.update(dict.fromkeys(episodes, why))
        if closed:
            self.sync()
            logger.info("ledger: %d open gateway episode(s) closed as abandoned", len(closed))
        return closed

    def dead_lettered(self, group_id: str, trajectory_ids: list[str], reason: str) -> None:
        """Records of ``group_id`` the dead-letter topic acknowledged instead of the raw one."""
        event = {"kind": "dead_lettered", "group_id": group_id, "trajectory_ids": trajectory_ids}
        self._append({**event, "reason": reason})
        self.state.dead_lettered[group_id] = trajectory_ids

    def _append(self, event: dict[str, Any], *, sync: bool = False) -> None:
        if self._fh is None:
            raise RuntimeError("ledger is not open")
        event["ts_ms"] = int(time.time() * 1000)
        self._fh.write(orjson.dumps(event) + b"\n")
        self._fh.flush()  # in the OS's hands: survives kill -9
        if sync and self.fsync:
            os.fsync(self._fh.fileno())  # on disk: survives a power cut
        self.state.lines += 1


def ledger_dir(state_dir: Path, run_id: str, producer_id: str, policy: str = "") -> Path:
    """A producer's ledger of one policy's topic (a multi-policy run: one per policy fed)."""
    run = Path(state_dir) / "producers" / run_id
    return (run / policy if policy else run) / producer_id


def read_ledger(path: Path) -> LedgerState:
    """Fold a ledger file into a ``LedgerState`` (a torn last line is ignored); a malformed
    line is refused (``ValueError`` naming it): the ledger is this producer's own word."""
    state = LedgerState()
    if not Path(path).exists():
        return state
    with Path(path).open("rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # torn tail
            line = state.lines
            state.lines += 1
            try:
                _fold(state, orjson.loads(raw), line)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"{path}:{line + 1}: malformed ledger line: {detail}") from exc
    return state


def _fold(state: LedgerState, event: dict[str, Any], line: int) -> None:
    """One ledger line into ``state``."""
    kind = event["kind"]
    gid = event.get("group_id")
    if kind == "mark":
        state.marks.append((line, {int(p): o for p, o in event["offsets"].items()}))
    elif kind == "pending":
        state.pending[gid] = PendingGroup(gid, event["trajectory_ids"], line)
        if "prompt_position" in event:
            state.positions[gid] = int(event["prompt_position"])
    elif kind in ("delivered", "orphaned", "lost"):
        state.pending.pop(gid, None)
        if kind == "lost":
            state.lost.add(gid)
        else:
            getattr(state, kind)[gid] = event["trajectory_ids"]
    elif kind == "abandoned":
        state.abandoned.setdefault(gid, {}).update(event["episodes"])
    elif kind == "episode_call":
        episode, call = event["episode_id"], event["call"]
        if not (isinstance(gid, str) and isinstance(episode, str) and _count(call)):
            raise ValueError("an episode_call needs string group_id, episode_id and a call >= 1")
        if not (_count(event["prompt_tokens"]) and _count(event["response_tokens"], 0)):
            raise ValueError("an episode_call's token counts must be whole numbers")
        state.episode_calls.setdefault(gid, {})[episode] = call
    elif kind == "dead_lettered":
        state.dead_lettered[gid] = event["trajectory_ids"]
    elif kind == "stopped":
        fields = ("policy", "finished", "aborted", "unacknowledged")
        state.stops.append(StopRecord(*(event[f] for f in fields), event.get("ts_ms", 0)))
    else:
        raise ValueError(f"unknown ledger event {kind!r}")


def _count(value: Any, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# --- Kafka side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryReport:
    delivered: int = 0
    orphaned: int = 0
    lost: int = 0
    scanned: int = 0


def recover(
    ledger: Ledger, client_config: Mapping[str, str], topic: str, timeout: float = 30.0
) -> RecoveryReport:
    """Resolve the groups a crash left pending by looking for their records in the topic."""
    pending = list(ledger.state.pending.values())
    if not pending:
        return RecoveryReport()
    oldest = min(p.line for p in pending)
    starts: dict[int, int] = {}
    for line, offsets in ledger.state.marks:
        if line < oldest:
            starts = offsets  # the last mark before the oldest pending group
    wanted = {tid: p.group_id for p in pending for tid in p.trajectory_ids}
    found = scan_for(client_config, topic, starts, wanted.keys(), timeout)
    report = {"delivered": 0, "orphaned": 0, "lost": 0}
    for group in pending:
        hits = [(tid, found[tid]) for tid in group.trajectory_ids if tid in found]
        if len(hits) == len(group.trajectory_ids):
            ledger.delivered(
                group.group_id, group.trajectory_ids, [pos for _, pos in hits], recovered=True
            )
            report["delivered"] += 1
        elif hits:
            ledger.orphaned(group.group_id, [t for t, _ in hits], [pos for _, pos in hits])
            report["orphaned"] += 1
        else:
            ledger.lost(group.group_id)
            report["lost"] += 1
    result = RecoveryReport(scanned=len(found), **report)
    logger.info(
        "ledger recovery: %d pending group(s): %d delivered, %d orphaned (partial), %d lost",
        len(pending),
        result.delivered,
        result.orphaned,
        result.lost,
    )
    return result


def scan_for(
    client_config: Mapping[str, str],
    topic: str,
    starts: Mapping[int, int],
    trajectory_ids: Iterable[str],
    timeout: float = 30.0,
) -> dict[str, tuple[int, int]]:
    """``{trajectory_id: (partition, offset)}`` for the wanted ids found in ``topic``,
    reading every partition from ``starts`` (default: the beginning) to its end."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    wanted = set(trajectory_ids)
    ends = end_offsets(client_config, topic, timeout)
    consumer = Consumer(
        {
            **client_config,
            "group.id": "rollstream-ledger-recovery",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    found: dict[str, tuple[int, int]] = {}
    try:
        todo = {p for p, end in ends.items() if end > starts.get(p, 0)}
        consumer.assign(
            [TopicPartition(topic, p, starts.get(p, OFFSET_BEGINNING)) for p in sorted(todo)]
        )
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ledger recovery: scanning {topic} took over {timeout}s")
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    if message.offset() >= ends[message.partition()]:
                        todo.discard(message.partition())
                    continue
                raise RuntimeError(f"ledger recovery: {message.error()}")
            for key, value in message.headers() or ():
                if key == TRAJECTORY_ID_HEADER and value is not None:
                    tid = value.decode()
                    if tid in wanted:
                        found[tid] = (message.partition(), message.offset())
            if message.offset() + 1 >= ends[message.partition()]:
                todo.discard(message.partition())
    finally:
        consumer.close()
    return found
