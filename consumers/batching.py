"""From consumed groups to padded tensors, and the log-prob layout the trainer uses.

Three pieces, none of them touching Kafka:

- ``ConsumedGroup``: one ``rollouts.scored`` record (a whole GRPO group) with the offset it
  came from. ``MicroBatch``: the groups one forward/backward pass sees, plus the offsets
  of *every* record it covers (records sent to the DLQ included), so the trainer always
  knows how far the trained data reaches in each partition.
- ``BatchAssembler``: closes a micro-batch at ``max_groups`` groups, before a group would
  exceed ``max_tokens``, or ``max_wait_s`` after its first group arrived (a slow
  partition never stalls training). Groups are never split.
- ``pack`` and ``response_logprobs``: response-aligned ``[B, T]`` tensors (``T`` the
  longest response, a response mask, and a loss mask that leaves out the environment
  tokens of multi-turn episodes: conditioned on, never trained) and ``logp_new`` computed by
  ``core.logprobs.response_logprobs_tensor``, the function the stream's old-logit
  service uses for ``logp_old``: same right-padded layout, position ids, float32
  log-softmax and temperature, so ``s = exp(logp_new - logp_old)`` carries no layout noise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from schemas.trajectory import OldLogitsStatus, Trajectory

if TYPE_CHECKING:
    import torch

TopicPartition = tuple[str, int]


@dataclass(frozen=True)
class ConsumedGroup:
    """One scored group and where it was read from."""

    topic: str
    partition: int
    offset: int
    group_id: str
    trajectories: tuple[Trajectory, ...]
    # the Kafka record as read, for routing it on unchanged (to rollouts.stale)
    key: bytes | None = None
    value: bytes = b""
    headers: tuple[tuple[str, bytes], ...] = ()

    def staleness(self, version: int) -> int:
        """``version`` minus the oldest segment version of any sample (what
        ``staleness/max`` reports when the group is trained at ``version``)."""
        return max(version - t.min_version for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        """Prompt + response tokens of every sample (unpadded)."""
        return sum(t.num_prompt_tokens + t.num_response_tokens for t in self.trajectories)


@dataclass(frozen=True)
class StaleGroup:
    """A group found too stale when it was about to be trained at ``trainer_version``
    (trainer step ``step`` was being gathered): routed to ``rollouts.stale`` once the
    checkpoint covering its offset is durable, and kept in that checkpoint until then."""

    step: int
    group_id: str
    trajectory_ids: tuple[str, ...]
    staleness: int
    trainer_version: int
    max_staleness: int
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]

    @classmethod
    def of(cls, group: ConsumedGroup, step: int, version: int, limit: int) -> StaleGroup:
        return cls(
            step=step,
            group_id=group.group_id,
            trajectory_ids=tuple(t.trajectory_id for t in group.trajectories),
            staleness=group.staleness(version),
            trainer_version=version,
            max_staleness=limit,
            topic=group.topic,
            partition=group.partition,
            offset=group.offset,
            key=group.key,
            value=group.value,
            headers=group.headers,
        )

    def to_state(self) -> dict[str, object]:
        """Plain values for a checkpoint's client state."""
        state = dict(self.__dict__)
        state["trajectory_ids"] = list(self.trajectory_ids)
        state["headers"] = [[k, v] for k, v in self.headers]
        return state

    @classmethod
    def from_state(cls, state: dict[str, object]) -> StaleGroup:
        values = dict(state)
        values["trajectory_ids"] = tuple(values["trajectory_ids"])  # type: ignore[arg-type]
        values["headers"] = tuple((k, v) for k, v in values["headers"])  # type: ignore[attr-defined]
        return cls(**values)  # type: ignore[arg-type]


@dataclass
class MicroBatch:
    """Groups for one forward/backward pass and the offsets of every record it covers.

    ``next_offsets[(topic, partition)]`` is one past the highest offset of any record of
    that partition in this batch (the Kafka convention for a committed position).
    """

    groups: list[ConsumedGroup] = field(default_factory=list)
    next_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    num_tokens: int = 0
    skipped: int = 0  # records covered but not trainable (DLQ)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def cover(self, topic: str, partition: int, offset: int) -> None:
        key = (topic, partition)
        self.next_offsets[key] = max(self.next_offsets.get(key, 0), offset + 1)


def merge_offsets(
    base: dict[TopicPartition, int], *more: dict[TopicPartition, int]
) -> dict[TopicPartition, int]:
    """Per-partition maximum of several ``next_offsets`` maps (a new dict)."""
    merged = dict(base)
    for offsets in more:
        for key, value in offsets.items():
            merged[key] = max(merged.get(key, 0), value)
    return merged


class BatchAssembler:
    """Accumulates consumed records into micro-batches (see the module doc)."""

    def __init__(
        self,
        max_groups: int,
        max_tokens: int | None,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_groups = max_groups
        self.max_tokens = max_tokens
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._current = MicroBatch()
        self._first_group_at: float | None = None
        self._ready: list[MicroBatch] = []

    def add_group(self, group: ConsumedGroup) -> None:
        """Take a group; it may close the current micro-batch first (token budget)."""
        cur = self._current
        if (
            self.max_tokens is not None
            and cur.groups
            and cur.num_tokens + group.num_tokens > self.max_tokens
        ):
            self._close()
            cur = self._current
        cur.groups.append(group)
        cur.num_tokens += group.num_tokens
        cur.cover(group.topic, group.partition, group.offset)
        if self._first_group_at is None:
            self._first_group_at = self._clock()
        if len(cur.groups) >= self.max_groups or (
            self.max_tokens is not None and cur.num_tokens >= self.max_tokens
        ):
            self._close()

    def add_skipped(self, topic: str, partition: int, offset: int) -> None:
        """A record that will not be trained (sent to the DLQ) still advances the offsets."""
        self._current.cover(topic, partition, offset)
        self._current.skipped += 1

    def seconds_left(self) -> float | None:
        """Until the current micro-batch times out; None when it holds no group."""
        if self._first_group_at is None:
            return None
        return max(0.0, self._first_group_at + self.max_wait_s - self._clock())

    def take(self) -> MicroBatch | None:
        """The next closed micro-batch, closing the current one if its wait is over."""
        if not self._ready:
            left = self.seconds_left()
            if left is not None and left <= 0.0:
                self._close()
        return self._ready.pop(0) if self._ready else None

    def pending_groups(self) -> int:
        return len(self._current.groups) + sum(len(b.groups) for b in self._ready)

    def _close(self) -> None:
        self._ready.append(self._current)
        self._current = MicroBatch()
        self._first_group_at = None


# --- the tensor layout ---------------------------------------------------------------


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch as response-aligned ``[B, T]`` tensors (``T`` = longest response):
    response_mask (every response token), loss_mask (the policy's tokens: what the loss,
    its denominators and token metrics cover), logp_infer, logp_old (0 where absent);
    ``[B]``: old_exact (the record's ``logp_old`` is exact), advantages. ``pairs`` are the
    (prompt_ids, response_ids) rows handed to ``core.logprobs`` in the same order."""

    pairs: tuple[tuple[np.ndarray, np.ndarray], ...]
    response_mask: torch.Tensor
    loss_mask: torch.Tensor
    logp_infer: torch.Tensor
    logp_old: torch.Tensor
    old_exact: torch.Tensor
    advantages: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Prompt + response tokens (unpadded)."""
        return sum(len(p) + len(r) for p, r in self.pairs)

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            pairs=self.pairs,
            response_mask=self.response_mask.to(device),
            loss_mask=self.loss_mask.to(device),
            logp_infer=self.logp_infer.to(device),
            logp_old=self.logp_old.to(device),
            old_exact=self.old_exact.to(device),
            advantages=self.advantages.to(device),
        )


def pack(trajectories: Sequence[Trajectory]) -> PackedBatch:
    """Response-aligned tensors for ``trajectories`` (on the CPU). Every record needs an
    advantage and a non-empty prompt; ``schemas.trainable.check_trainable`` says why one
    does not qualify."""
    import torch

    if not trajectories:
        raise ValueError("cannot pack an empty batch")
    batch = len(trajectories)
    width = max(max(t.num_response_tokens for t in trajectories), 1)
    resp_mask = np.zeros((batch, width), dtype=bool)
    loss_mask = np.zeros((batch, width), dtype=bool)
    logp_infer = np.zeros((batch, width), dtype=np.float32)
    logp_old = np.zeros((batch, width), dtype=np.float32)
    old_exact = np.zeros(batch, dtype=bool)
    advantages = np.zeros(batch, dtype=np.float32)
    for i, traj in enumerate(trajectories):
        r = traj.num_response_tokens
        resp_mask[i, :r] = True
        loss_mask[i, :r] = traj.loss_mask if traj.turn_kinds is not None else True
        logp_infer[i, :r] = traj.logp_infer
        if traj.logp_old is not None and traj.old_logits_status == OldLogitsStatus.EXACT:
            logp_old[i, :r] = traj.logp_old
            old_exact[i] = True
        if traj.advantage is None:
            raise ValueError(f"trajectory {traj.trajectory_id} has no advantage")
        advantages[i] = traj.advantage
    return PackedBatch(
        pairs=tuple((t.prompt_ids, t.response_ids) for t in trajectories),
        response_mask=torch.from_numpy(resp_mask),
        loss_mask=torch.from_numpy(loss_mask),
        logp_infer=torch.from_numpy(logp_infer),
        logp_old=torch.from_numpy(logp_old),
        old_exact=torch.from_numpy(old_exact),
        advantages=torch.from_numpy(advantages),
    )


def response_logprobs(
    model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0, pad_id: int = 0
) -> torch.Tensor:
    """``[B, T]`` float32 log-probs of the response tokens under ``model`` (0 outside the
    response mask), through ``core.logprobs.response_logprobs_tensor``: the very
    function (layout, dtype path, temperature) the stream uses for ``logp_old``. Carries
    the gradient when called with grad enabled."""
    from core.logprobs import response_logprobs_tensor

    logp, _mask = response_logprobs_tensor(
        model, batch.pairs, temperature=temperature, pad_id=pad_id
    )
    return logp


def response_logprobs_entropy(
    model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``response_logprobs`` and the ``[B, T]`` entropy at each response token (no
    gradient), from one forward pass."""
    from core.logprobs import response_logprobs_entropy as logprobs_entropy

    logp, _mask, entropy = logprobs_entropy(
        model, batch.pairs, temperature=temperature, pad_id=pad_id
    )
    return logp, entropy
