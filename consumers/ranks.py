"""Data-parallel trainer ranks fed by rank 0.

The pattern (as slime, verl and AstraFlow feed their trainer ranks): **rank 0 alone
consumes** ``rollouts.scored``, judges staleness, keeps the checkpoint's Kafka offsets and
the training ledger, publishes weights and writes metrics. For every step it splits each
of its ``grad_accum_steps`` micro-batches into ``world`` shares balanced by token count
(``split_for_ranks``) and sends rank ``r`` share ``r`` of each. Every rank runs the same
optimiser step on its shares; DeepSpeed averages the gradients across ranks.

So a step of world ``N`` with ``grad_accum_steps = k`` trains exactly what a world of one
trains with ``grad_accum_steps = N x k`` and the shares as its micro-batches (each
micro-batch's loss is normalised over its own tokens, then averaged): the test of the
ranks checks that equality. A record is trained by exactly one rank, and only rank 0
decides what a step holds, so the exactly-once argument of one rank carries over: the
checkpoint (written by all ranks together, DeepSpeed's collective save) holds rank 0's
offsets, and they are committed only once it is durable. A rank that dies takes the
world down (the launcher stops the others); a restart of the world resumes from the
last checkpoint.

The orders rank 0 sends are small dataclasses moved with torch.distributed's object
collectives (pickle over gloo or NCCL's CPU side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from schemas.trajectory import Trajectory


def record_tokens(traj: Trajectory) -> int:
    """What a record costs a rank: its forward and backward run over every token."""
    return traj.num_prompt_tokens + traj.num_response_tokens


def split_for_ranks(records: Sequence[Trajectory], world: int) -> list[list[Trajectory]]:
    """``world`` shares of ``records`` balanced by token count (longest first, each to the
    lightest share; ties by trajectory id, then rank), each share in the input order.

    Deterministic, so a test (or ``replay``) recomputes the shares from the step's
    records. With fewer records than ranks some shares are empty.
    """
    loads = [0] * world
    owner: dict[int, int] = {}

    def heaviest_first(i: int) -> tuple[int, str]:
        return -record_tokens(records[i]), records[i].trajectory_id

    order = sorted(range(len(records)), key=heaviest_first)
    for i in order:
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += record_tokens(records[i])
    return [[records[i] for i in range(len(records)) if owner[i] == r] for r in range(world)]


def token_imbalance(shares: Sequence[Sequence[Trajectory]]) -> float:
    """(most - fewest) / mean tokens over the ranks' shares: 0 when perfectly balanced."""
    tokens = [sum(record_tokens(t) for t in share) for share in shares]
    mean = sum(tokens) / len(tokens) if tokens else 0.0
    return (max(tokens) - min(tokens)) / mean if mean > 0 else 0.0


@dataclass
class TrainOrder:
    """One rank's part of a step: its shares of the step's micro-batches."""

    step: int
    micro_batches: list[list[Trajectory]]
    relaxed: set[str] = field(default_factory=set)


@dataclass
class CheckpointOrder:
    """Save a checkpoint together (DeepSpeed's save is collective)."""

    state: Any  # consumers.checkpoint.TrainerState


@dataclass
class WeightsOrder:
    """Take part in gathering the full weights (collective under ZeRO-3)."""


@dataclass
class StopOrder:
    """Rank 0 is done: leave the loop."""


Order = TrainOrder | CheckpointOrder | WeightsOrder | StopOrder


class RankChannel:
    """Rank 0 hands orders out; the other ranks wait for theirs and report metrics."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world

    def scatter(self, orders: Sequence[Order]) -> Order:
        """Rank 0: one order per rank (its own is returned). Others: pass ``[]``."""
        received: list[Any] = [None]
        torch.distributed.scatter_object_list(
            received, list(orders) if self.rank == 0 else None, src=0
        )
        return received[0]

    def gather_metrics(self, metrics: dict[str, float]) -> list[dict[str, float]] | None:
        """Every rank's step metrics, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        torch.distributed.gather_object(metrics, out, dst=0)
        return out
