"""Crash-safe checkpoints that carry the Kafka offsets they cover, and the training ledger.

Layout of ``checkpoint.dir``::

    step000000040/        one DeepSpeed checkpoint per tag (weights, fp32 master, optimiser)
    step000000050/
    LATEST                {"tag": "step000000050", "step": 50}: the newest *durable* one

``save`` writes a DeepSpeed checkpoint whose client state holds the trainer's state
(``TrainerState``: step, the next offset of every partition whose records are trained
into these weights, the ledger entries since the previous checkpoint, the EWMA), fsyncs
every file of it, and only then replaces ``LATEST`` atomically (write a temporary file,
fsync, rename, fsync the directory). A crash at any point leaves ``LATEST`` naming a
complete checkpoint; a half-written tag directory is ignored and later removed.

The trainer commits offsets to Kafka only after ``save`` returns, and on restart seeks
to the offsets in the checkpoint (not to Kafka's committed ones, which may lag after a
crash between the two).

Groups found too stale to train while gathering a step (``consumers.batching.StaleGroup``,
the record bytes included) travel in the checkpoint too, and go to ``rollouts.stale``
only once it is durable, before the ledger lines of their steps are appended: a ledger
that lacks a checkpoint's steps after a crash means their stale groups may not have been
routed either, and the trainer routes them again from the checkpoint (so a stale group
is routed at least once and only when the offsets past it are durable: never trained
after a restart that re-reads it, never lost).

``TrainingLedger``: a JSONL file, one line per optimiser step
``{"step": n, "trajectory_ids": [...], "micro_batches": [[...], ...], "relaxed_ids": [...],
"stale_ids": [...]}`` (``trajectory_ids``: the samples trained; ``micro_batches``: the
samples handed to the step, micro-batch by micro-batch, in order, and ``relaxed_ids`` those
clipped with the relaxed bounds: together the step's exact composition, which
``rollstream fork`` trains again; ``stale_ids``: the samples
of the groups routed as stale while that step was gathered; ``refused_ids``, when there
are any: the samples of groups refused as already trained), appended only for steps
covered by a durable checkpoint. The entries of the steps since the previous checkpoint
travel inside the checkpoint itself, so after a crash between the checkpoint and the ledger append,
``reconcile`` writes the missing lines from the loaded checkpoint. The ledger therefore
lists exactly the trajectories whose gradient is in the latest checkpoint's weights,
each once per time it was trained: the audit of exactly-once training.

A guard's rollback (``consumers.guards``) adds a line without ``step``:
``{"rollback": n, "at_step": s, "to_step": c, "to_tag": ..., "guard": ..., "reason": ...}``:
the weights after step ``s`` are those of the checkpoint of step ``c``, so the gradient of
every trajectory of the ledger's steps ``c < step <= s`` was discarded. Steps go on from
``s`` (no step number is reused and no offset rewinds): those trajectories are trained
once and rolled back, never trained again. The rollback travels in the checkpoint saved
right after it, like ledger entries, so a crash before its line is written writes it on
restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from consumers.batching import StaleGroup, TopicPartition
from consumers.config import CheckpointConfig
from consumers.failpoint import failpoint
from consumers.train_engine import TrainEngine, barrier, rank

log = logging.getLogger(__name__)

LATEST_NAME = "LATEST"
_TAG = re.compile(r"step(\d{9})(?:-(\d+))?")
_CLIENT_KEY = "rollstream"


def tag_for(step: int, revision: int = 0) -> str:
    """``step000000042``; a later checkpoint of the same step (records set aside at a
    stop, with no step trained since) is ``step000000042-1``: the durable one is never
    overwritten."""
    return f"step{step:09d}" + (f"-{revision}" if revision else "")


def tag_order(tag: str) -> tuple[int, int] | None:
    """``(step, revision)`` of a checkpoint directory name; None for anything else."""
    match = _TAG.fullmatch(tag)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


class Rollback(NamedTuple):
    """A guard's rollback as the ledger keeps it (see the module doc)."""

    number: int  # 1, 2, ... in the run
    at_step: int
    to_step: int
    to_tag: str
    guard: str
    reason: str

    def to_row(self) -> dict[str, Any]:
        return {
            "rollback": self.number,
            "at_step": self.at_step,
            "to_step": self.to_step,
            "to_tag": self.to_tag,
            "guard": self.guard,
            "reason": self.reason,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Rollback:
        return cls(
            int(row["rollback"]),
            int(row["at_step"]),
            int(row["to_step"]),
            str(row["to_tag"]),
            str(row["guard"]),
            str(row["reason"]),
        )


class LedgerStep(NamedTuple):
    """One trained step as the ledger keeps it (``micro_batches`` None: a line written
    before compositions were recorded)."""

    step: int
    trajectory_ids: list[str]
    micro_batches: list[list[str]] | None = None
    relaxed_ids: Sequence[str] = ()

    def to_state(self) -> list[Any]:
        return [self.step, list(self.trajectory_ids), self.micro_batches, list(self.relaxed_ids)]

    @classmethod
    def from_state(cls, raw: Sequence[Any]) -> LedgerStep:
        """From ``to_state`` (or the ``[step, ids]`` pair of older checkpoints)."""
        step, ids, *rest = raw
        batches = rest[0] if rest else None
        return cls(
            int(step),
            [str(i) for i in ids],
            None if batches is None else [[str(i) for i in b] for b in batches],
            [str(i) for i in rest[1]] if len(rest) > 1 else [],
        )


@dataclass
class TrainerState:
    """What a checkpoint records besides the engine state."""

    step: int = 0
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    ledger: list[LedgerStep] = field(default_factory=list)
    runner: dict[str, Any] = field(default_factory=dict)
    last_published: int | None = None
    stale: list[StaleGroup] = field(default_factory=list)  # since the previous checkpoint
    # group ids trained lately (oldest first, bounded: ``consumers.recent``), and the sample
    # ids of groups refused as already trained, per step, since the previous checkpoint
    recent_groups: list[str] = field(default_factory=list)
    refused: list[tuple[int, list[str]]] = field(default_factory=list)
    guards: dict[str, Any] = field(default_factory=dict)  # consumers.guards.GuardState
    rollbacks: list[Rollback] = field(default_factory=list)  # since the previous checkpoint

    def to_client_state(self) -> dict[str, Any]:
        return {
            _CLIENT_KEY: {
                "step": self.step,
                "offsets": [[t, p, o] for (t, p), o in sorted(self.offsets.items())],
                "ledger": [entry.to_state() for entry in self.ledger],
                "runner": self.runner,
                "last_published": self.last_published,
                "stale": [g.to_state() for g in self.stale],
                "recent_groups": list(self.recent_groups),
                "refused": [[s, list(ids)] for s, ids in self.refused],
                "guards": self.guards,
                "rollbacks": [r.to_row() for r in self.rollbacks],
            }
        }

    @classmethod
    def from_client_state(cls, client_state: dict[str, Any]) -> TrainerState:
        raw = client_state.get(_CLIENT_KEY)
        if raw is None:
            raise ValueError("checkpoint has no rollstream trainer state")
        return cls(
            step=int(raw["step"]),
            offsets={(str(t), int(p)): int(o) for t, p, o in raw["offsets"]},
            ledger=[LedgerStep.from_state(entry) for entry in raw["ledger"]],
            runner=dict(raw.get("runner") or {}),
            last_published=raw.get("last_published"),
            stale=[StaleGroup.from_state(g) for g in raw.get("stale") or []],
            recent_groups=[str(g) for g in raw.get("recent_groups") or []],
            refused=[(int(s), [str(i) for i in ids]) for s, ids in raw.get("refused") or []],
            guards=dict(raw.get("guards") or {}),
            rollbacks=[Rollback.from_row(r) for r in raw.get("rollbacks") or []],
        )


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def write_atomic(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new bytes."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if fsync:
        _fsync_path(path.parent)


class CheckpointManager:
    """Saves and finds checkpoints under ``config.dir`` (see the module doc)."""

    def __init__(self, config: CheckpointConfig) -> None:
        if config.dir is None:
            raise ValueError("checkpoint.dir is not set (resolve it against the state dir)")
        self.config = config
        self.dir = Path(config.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def latest(self) -> tuple[str, int] | None:
        """``(tag, step)`` of the newest durable checkpoint, or None. The tag is used as a
        directory name, so a marker whose tag is not a checkpoint tag of its own step (a
        path such as ``../other``, a hand edit) is refused with ``ValueError``."""
        marker = self.dir / LATEST_NAME
        if not marker.exists():
            return None
        try:
            data = orjson.loads(marker.read_bytes())
            tag, step = data["tag"], data["step"]
        except (orjson.JSONDecodeError, TypeError, KeyError) as err:
            raise ValueError(f"{marker} is not a checkpoint marker: {err}") from err
        order = tag_order(tag) if isinstance(tag, str) else None
        if order is None or type(step) is not int or order[0] != step:
            raise ValueError(
                f"{marker} names tag {tag!r} at step {step!r}: not a checkpoint of that step "
                f"(tags look like {tag_for(7)!r})"
            )
        return tag, step

    def save(self, engine: TrainEngine, state: TrainerState) -> str:
        """Write a checkpoint of ``engine`` + ``state`` and mark it LATEST once durable."""
        tag = tag_for(state.step)
        latest = self.latest()
        if latest is not None and latest[1] == state.step:
            _step, revision = tag_order(latest[0]) or (state.step, 0)
            tag = tag_for(state.step, revision + 1)
        target = self.dir / tag
        if rank() == 0 and target.exists():  # a torn attempt from before a crash
            shutil.rmtree(target)
        barrier()
        engine.save_checkpoint(self.dir, tag, state.to_client_state())
        barrier()
        failpoint("mid_checkpoint", state.step)  # written, not yet LATEST: a torn attempt
        if rank() == 0:
            if self.config.fsync:
                _fsync_tree(target)
            write_atomic(
                self.dir / LATEST_NAME,
                orjson.dumps({"tag": tag, "step": state.step}),
                fsync=self.config.fsync,
            )
            self._prune(keep_tag=tag)
        barrier()
        return tag

    def adopt(self, source: Path, step: int) -> str:
        """Copy the durable checkpoint of ``step`` from another checkpoint directory
        (``source``, another run's) here and mark it LATEST: a fork that starts from that
        step; ``FileNotFoundError`` naming the steps ``source`` still holds."""
        marker = Path(source) / LATEST_NAME
        newest = tag_order(orjson.loads(marker.read_bytes())["tag"]) if marker.exists() else None
        durable = {
            order: path.name
            for path in Path(source).iterdir()
            if path.is_dir()
            and (order := tag_order(path.name)) is not None
            and newest is not None
            and order <= newest
        }
        found = [tag for (s, _r), tag in sorted(durable.items()) if s == step]
        if not found:
            held = sorted({s for s, _r in durable})
            raise FileNotFoundError(
                f"no checkpoint of step {step} in {source} (it holds steps {held}; "
                "[trainer.checkpoint] keep sets how many are kept)"
            )
        tag = found[-1]
        target = self.dir / tag
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(Path(source) / tag, target)
        if self.config.fsync:
            _fsync_tree(target)
        write_atomic(
            self.dir / LATEST_NAME,
            orjson.dumps({"tag": tag, "step": step}),
            fsync=self.config.fsync,
        )
        return tag

    def kept(self) -> dict[str, int]:
        """``tag -> step`` of the complete checkpoints up to LATEST (the rollback targets)."""
        found = self.latest()
        newest = tag_order(found[0]) if found is not None else None
        return {
            p.name: order[0]
            for p in self.dir.iterdir()
            if p.is_dir()
            and (order := tag_order(p.name)) is not None
            and newest is not None
            and order <= newest
        }

    def load_tag(self, engine: TrainEngine, tag: str) -> TrainerState:
        """Restore the kept checkpoint ``tag`` into ``engine``, its step counters kept (a
        guard's rollback); LATEST is not touched: the caller saves a new checkpoint next."""
        if tag not in self.kept():
            raise FileNotFoundError(f"no kept checkpoint {tag!r} in {self.dir}")
        return TrainerState.from_client_state(engine.rewind(self.dir, tag))

    def load(self, engine: TrainEngine) -> TrainerState | None:
        """Restore the LATEST checkpoint into ``engine``; None when there is none."""
        found = self.latest()
        if found is None:
            return None
        tag, step = found
        client_state = engine.load_checkpoint(self.dir, tag)
        state = TrainerState.from_client_state(client_state)
        if state.step != step:
            raise ValueError(f"checkpoint {tag} holds step {state.step}, LATEST says {step}")
        if rank() == 0:
            self._prune(keep_tag=tag)
        return state

    def _prune(self, keep_tag: str) -> None:
        """Keep the newest ``config.keep`` complete checkpoints up to LATEST; remove
        older ones and any torn directory newer than LATEST."""
        keep = tag_order(keep_tag)
        assert keep is not None, keep_tag
        tags = sorted(
            (order, p)
            for p in self.dir.iterdir()
            if p.is_dir() and (order := tag_order(p.name)) is not None
        )
        complete = [(s, p) for s, p in tags if s <= keep]
        doomed = [p for s, p in tags if s > keep]
        doomed += [p for _, p in complete[: max(0, len(complete) - self.config.keep)]]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)


class TrainingLedger:
    """Append-only JSONL of the trajectory ids trained per checkpointed step."""

    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last_rollback = 0  # the highest rollback number with a line
        self._last_step = self._repair()

    @property
    def last_step(self) -> int:
        """The highest step with a line (0 when empty)."""
        return self._last_step

    def _repair(self) -> int:
        """Cut a torn last line (kill -9 mid-write); return the last complete step."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            log.warning(
                "ledger %s: dropping a torn last line (%d bytes)", self.path, len(data) - end
            )
            with self.path.open("r+b") as fh:
                fh.truncate(end)
                if self.fsync:
                    os.fsync(fh.fileno())
        last = 0
        for line in data[:end].splitlines():
            if line.strip():
                row = orjson.loads(line)
                if "step" in row:
                    last = max(last, int(row["step"]))
                elif "rollback" in row:
                    self._last_rollback = max(self._last_rollback, int(row["rollback"]))
        return last

    def append(
        self,
        entries: Sequence[LedgerStep | tuple[int, list[str]]],
        stale: Sequence[StaleGroup] = (),
        refused: Sequence[tuple[int, list[str]]] = (),
    ) -> int:
        """Append entries of steps after ``last_step`` (others are already there), each
        with the sample ids of ``stale`` groups of its step and of groups ``refused`` as
        already trained while it was gathered; returns how many lines were written."""
        fresh = [LedgerStep(*e) for e in entries if e[0] > self._last_step]
        if not fresh:
            return 0
        stale_ids: dict[int, list[str]] = {}
        for group in stale:
            stale_ids.setdefault(group.step, []).extend(group.trajectory_ids)
        refused_ids: dict[int, list[str]] = {}
        for step, ids in refused:
            refused_ids.setdefault(step, []).extend(ids)
        payload = b"".join(
            orjson.dumps(
                {
                    "step": e.step,
                    "trajectory_ids": e.trajectory_ids,
                    **({} if e.micro_batches is None else {"micro_batches": e.micro_batches}),
                    "relaxed_ids": list(e.relaxed_ids),
                    "stale_ids": stale_ids.get(e.step, []),
                    **({"refused_ids": refused_ids[e.step]} if e.step in refused_ids else {}),
                }
            )
            + b"\n"
            for e in fresh
        )
        with self.path.open("ab") as fh:
            fh.write(payload)
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        self._last_step = max(e.step for e in fresh)
        return len(fresh)

    def append_rollbacks(self, rollbacks: Sequence[Rollback]) -> int:
        """Append the rollbacks the ledger lacks (by number); returns how many."""
        fresh = [r for r in rollbacks if r.number > self._last_rollback]
        if not fresh:
            return 0
        with self.path.open("ab") as fh:
            fh.write(b"".join(orjson.dumps(r.to_row()) + b"\n" for r in fresh))
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        self._last_rollback = max(r.number for r in fresh)
        return len(fresh)

    @staticmethod
    def _all_rows(path: Path) -> Iterator[dict[str, Any]]:
        """Every complete line of a ledger (a torn last line is ignored; none if missing)."""
        with contextlib.suppress(FileNotFoundError):
            for line in Path(path).read_bytes().splitlines(keepends=True):
                if line.endswith(b"\n") and line.strip():
                    yield orjson.loads(line)

    @staticmethod
    def _rows(path: Path) -> Iterator[dict[str, Any]]:
        """Every complete step line (rollback lines left out)."""
        return (row for row in TrainingLedger._all_rows(path) if "step" in row)

    @staticmethod
    def read_rollbacks(path: Path) -> list[Rollback]:
        """Every rollback line, in order."""
        return [Rollback.from_row(r) for r in TrainingLedger._all_rows(path) if "rollback" in r]

    @staticmethod
    def rolled_back_steps(path: Path) -> set[int]:
        """The ledger steps whose gradient a rollback discarded."""
        return rolled_back_steps(TrainingLedger.read_rollbacks(path))

    @staticmethod
    def rolled_back_ids(path: Path) -> tuple[Counter[str], list[str]]:
        """Ids trained into steps a rollback discarded (once per such training), and what
        is wrong with the rollback lines (a rollback of a step the ledger lacks)."""
        rollbacks = TrainingLedger.read_rollbacks(path)
        steps = rolled_back_steps(rollbacks)
        ledger = TrainingLedger.read(path)
        known = {step for step, _ in ledger}
        wrong = [
            f"rollback {r.number} of steps {r.to_step + 1}..{r.at_step}: the ledger lacks "
            f"step {r.at_step}"
            for r in rollbacks
            if r.at_step not in known or r.to_step >= r.at_step
        ]
        return Counter(t for step, ids in ledger if step in steps for t in ids), wrong

    @staticmethod
    def read_stale(path: Path) -> list[tuple[int, list[str]]]:
        """``(step, stale sample ids)`` of every complete line (lines written before stale
        routing existed have none)."""
        return [
            (int(row["step"]), list(row.get("stale_ids") or []))
            for row in TrainingLedger._rows(path)
        ]

    @staticmethod
    def read_refused(path: Path) -> list[str]:
        """Sample ids of every group the trainer refused as already trained (a group
        scored twice upstream), once per refusal."""
        return [i for row in TrainingLedger._rows(path) for i in row.get("refused_ids") or []]

    @staticmethod
    def read_steps(path: Path) -> list[LedgerStep]:
        """Every complete line as a ``LedgerStep``, compositions included."""
        return [
            LedgerStep.from_state(
                [
                    row["step"],
                    row["trajectory_ids"],
                    row.get("micro_batches"),
                    row.get("relaxed_ids") or [],
                ]
            )
            for row in TrainingLedger._rows(path)
        ]

    @staticmethod
    def read(path: Path) -> list[tuple[int, list[str]]]:
        """Every complete line of a ledger (a torn last line is ignored)."""
        return [
            (int(row["step"]), list(row["trajectory_ids"])) for row in TrainingLedger._rows(path)
        ]


def rolled_back_steps(rollbacks: Sequence[Rollback]) -> set[int]:
    """Steps ``to_step < step <= at_step`` of every rollback (a step rolled back twice,
    once in the set)."""
    return {s for r in rollbacks for s in range(r.to_step + 1, r.at_step + 1)}
