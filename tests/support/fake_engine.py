"""Stand-ins for the rollout worker's engine and publisher, for tests of the worker's own
logic (admission, version policies, pause reasons) without a model, a broker or timing.

``FakeBackend`` speaks the worker's ``Backend`` protocol. Generation advances one token
per event-loop turn, and stops when the test says so: ``hold_after(n)`` parks every request
once ``n`` tokens have been generated in all, until ``release()``; ``abort`` ends the
named requests at once with what they have, as a real engine's abort does. So a test can
put a version change exactly mid-generation instead of slowing a real engine down.

``FakePublisher`` keeps the published groups in memory and acknowledges them when the
test calls ``acknowledge()`` (or at once, with ``auto_ack``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producers.config import RolloutConfig, SamplingConfig
from producers.engine.client import GenerateOutput
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.publishing import Outbox, ProducerIdentity
from producers.rollout.worker import RolloutWorker
from producers.tasks.base import TaskContext
from producers.tasks.catalog import make_task
from schemas.trajectory import Trajectory

TOKEN = 7  # every generated token (inside the tiny vocabulary)
LOGPROB = -0.5


@dataclass
class FakeBackend:
    """An engine whose progress the test controls."""

    version: int = 0
    generated: int = 0
    calls: list[list[str]] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    _hold_at: int | None = None
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    def hold_after(self, tokens: int) -> None:
        """Park every request once ``tokens`` tokens were generated in all."""
        self._hold_at = tokens
        self._released.clear()

    def release(self) -> None:
        self._hold_at = None
        self._released.set()

    async def wait_generated(self, tokens: int) -> None:
        while self.generated < tokens:
            await asyncio.sleep(0)

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[dict[str, Any]],
        rids: Sequence[str],
        *,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
    ) -> list[GenerateOutput]:
        self.calls.append(list(rids))
        return list(
            await asyncio.gather(
                *(
                    self._one(p, s, r, on_tokens)
                    for p, s, r in zip(prompts, sampling, rids, strict=True)
                )
            )
        )

    async def _one(
        self,
        prompt: Sequence[int],
        params: dict[str, Any],
        rid: str,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
    ) -> GenerateOutput:
        ids: list[int] = []
        version = self.version
        for _ in range(int(params["max_new_tokens"])):
            while self._hold_at is not None and self.generated >= self._hold_at:
                if rid in self.aborted:
                    break
                await asyncio.sleep(0)
            if rid in self.aborted:
                return _output(rid, ids, "abort", len(prompt), version)
            ids.append(TOKEN)
            self.generated += 1
            if on_tokens is not None:  # as a streaming engine tells them
                on_tokens(list(ids), [LOGPROB] * len(ids))
            await asyncio.sleep(0)
        return _output(rid, ids, "length", len(prompt), version)

    async def abort(self, rids: Sequence[str]) -> None:
        self.aborted.update(rids)

    async def load_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        self.loaded.append(version)
        self.version = version

    async def model_info(self) -> dict[str, Any]:
        return {"weight_version": str(self.version)}

    async def aclose(self) -> None:
        return None


def _output(
    rid: str, ids: list[int], finish: str, prompt_tokens: int, version: int
) -> GenerateOutput:
    return GenerateOutput(
        rid=rid,
        output_ids=list(ids),
        logprobs=[LOGPROB] * len(ids),
        finish_type=finish,
        finish_reason={"type": finish},
        prompt_tokens=prompt_tokens,
        weight_version=str(version),
        text="",
    )


class FakeLedger:
    def mark(self, offsets: Mapping[int, int]) -> None:
        return None


@dataclass
class FakePublisher:
    """Publishes into a list; a group counts as delivered once acknowledged."""

    auto_ack: bool = True
    metrics: ProducerMetrics = field(default_factory=ProducerMetrics)
    groups: list[list[Trajectory]] = field(default_factory=list)
    acknowledged: int = 0
    ledger: FakeLedger = field(default_factory=FakeLedger)

    @property
    def delivered_groups(self) -> int:
        return self.acknowledged

    @property
    def delivered_trajectories(self) -> int:
        return sum(len(g) for g in self.groups[: self.acknowledged])

    @property
    def undelivered_groups(self) -> int:
        return len(self.groups) - self.acknowledged

    async def publish_async(self, group_id: str, trajectories: Sequence[Trajectory]) -> None:
        self.groups.append(list(trajectories))
        if self.auto_ack:
            self.acknowledged = len(self.groups)

    def acknowledge(self) -> None:
        self.acknowledged = len(self.groups)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 30) -> int:
        self.acknowledge()
        return 0


TOKENS = 6  # per sample


def fake_worker(
    backend: FakeBackend, publisher: FakePublisher | None = None, **rollout: object
) -> RolloutWorker:
    """A rollout worker of the tiny digit task over ``backend``, its groups to
    ``publisher``; ``rollout``: ``[producers.rollout]`` settings over the defaults."""
    config = RolloutConfig.model_validate(
        {
            "group_size": 2,
            "seed": 0,
            "progress": False,
            "follow_weights": False,
            "ledger_fsync": False,
            "sampling": SamplingConfig(max_new_tokens=TOKENS, ignore_eos=True, stop_token_ids=[]),
            **rollout,
        }
    )
    task = make_task("copy-first-digit-twice", None, TaskContext(cache_dir=Path("/nonexistent")))
    return RolloutWorker(
        config,
        backend,
        task,
        Outbox(publisher or FakePublisher()),  # type: ignore[arg-type]
        ProducerIdentity(run_id="run", producer_id="p0", region="local"),
    )
