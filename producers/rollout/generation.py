"""Generation: a group's G samples (or G episodes) from the engine, through version changes.

The G samples of a group go to the engine as one batch request, each with its own rid; an
environment's G episodes run side by side, each turn its own call, so the engine batches
their turns as it batches a single-turn group. A sample's response is a list of segments
``(version, tokens)``: a sample cut by a version change (``EngineVersions``) is continued
from prompt + partial response on the new weights (``interrupt``) or regenerated from
scratch (``abort``) until it finishes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from producers.config import RolloutConfig
from producers.engine.client import EngineError, GenerateOutput
from producers.engine.streaming import TokenProgress
from producers.rollout.episodes import EpisodeResult, EpisodeRunner, GenerateTurn
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.versions import EngineVersions, Stopped
from producers.tasks.base import Prompt, Task
from producers.tasks.environments import EpisodeLimits, is_environment


@dataclass
class Sample:
    """One finished response with its per-version segments."""

    response_ids: list[int]
    logprobs: list[float]
    segments: list[list[int]]  # [version, length] pairs, versions non-decreasing
    finish_type: str
    finished_at_ms: int
    interruptions: int = 0


def now_ms() -> int:
    return int(time.time() * 1000)


def _after(
    ids: list[int], logprobs: list[float], on_tokens: TokenProgress | None
) -> TokenProgress | None:
    """``on_tokens`` told of a continued sample's tokens after those it already has."""
    if on_tokens is None:
        return None
    kept_ids, kept_logprobs = list(ids), list(logprobs)

    def progress(new_ids: list[int], new_logprobs: list[float]) -> None:
        on_tokens(kept_ids + new_ids, kept_logprobs + new_logprobs)

    return progress


class GroupGenerator:
    """Generates the groups of one task with the worker's engine."""

    def __init__(
        self,
        engine: EngineVersions,
        task: Task,
        config: RolloutConfig,
        metrics: ProducerMetrics,
        *,
        vocab_size: int | None = None,
    ) -> None:
        self.engine = engine
        self.task = task
        self.config = config
        self.metrics = metrics
        self.episodes: EpisodeRunner | None = None
        if is_environment(task):
            limits: EpisodeLimits = task.limits  # type: ignore[attr-defined]
            limits = dataclasses.replace(limits, **config.episode.overrides())
            self.episodes = EpisodeRunner(task, limits, vocab_size)  # type: ignore[arg-type]
        self.tokens = 0  # generated, in all
        self.interrupted = 0  # samples cut by a version change, counted per cut

    async def group(self, prompt: Prompt, group_id: str) -> list[Sample]:
        """The G samples of a single-turn group, one batch request."""
        size = self.config.group_size
        params = self.config.sampling.to_sglang(self.task.max_new_tokens, self.task.stop_token_ids)
        rids = [f"{group_id}-{i}-0" for i in range(size)]
        outputs, version, swaps = await self._call([prompt.ids] * size, [params] * size, rids)
        return list(
            await asyncio.gather(
                *(
                    self._complete(prompt.ids, params, f"{group_id}-{i}", out, version, swaps)
                    for i, out in enumerate(outputs)
                )
            )
        )

    async def episodes_of(self, prompt: Prompt, group_id: str) -> list[EpisodeResult]:
        """The G episodes of a group, side by side: their turns reach the engine
        concurrently, so it batches them as it batches a single-turn group."""
        runner = self.episodes
        if runner is None:
            raise TypeError(f"task {self.task.name!r} is not an environment")

        def turn_of(index: int) -> GenerateTurn:
            async def generate_turn(history: list[int], max_new_tokens: int, turn: int) -> Sample:
                stop = getattr(self.task, "stop", None)
                return await self.turn(history, max_new_tokens, f"{group_id}-{index}-t{turn}", stop)

            return generate_turn

        size = self.config.group_size
        return list(await asyncio.gather(*(runner.run(prompt, turn_of(i)) for i in range(size))))

    async def turn(
        self,
        history: list[int],
        max_new_tokens: int,
        rid: str,
        stop: list[str] | None = None,
        on_tokens: TokenProgress | None = None,
    ) -> Sample:
        """One policy turn continuing ``history``, with the run's sampling and the task's
        stop tokens (``stop``: strings that end it too), followed through version
        changes. ``max_new_tokens`` is the turn's hard budget (the room left in an episode,
        a gateway client's ``max_tokens``): ``sampling.max_new_tokens`` may lower it, never
        raise it. ``on_tokens`` is told of the turn's tokens so far as they are drawn
        (across a version change they only grow); under ``version_policy = "abort"``,
        which may discard them, it is told nothing."""
        params = self.config.sampling.to_sglang(max_new_tokens, self.task.stop_token_ids, stop)
        params["max_new_tokens"] = min(int(params["max_new_tokens"]), max_new_tokens)
        if self.config.version_policy == "abort":
            on_tokens = None
        progress = _after([], [], on_tokens)
        outputs, version, swaps = await self._call([history], [params], [f"{rid}-0"], progress)
        return await self._complete(
            history, params, rid, outputs[0], version, swaps, on_tokens=on_tokens
        )

    async def _complete(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        rid_prefix: str,
        out: GenerateOutput,
        version: int,
        swaps: int,
        *,
        on_tokens: TokenProgress | None = None,
    ) -> Sample:
        """Follow one sample through interruptions until it finishes."""
        ids: list[int] = []
        logprobs: list[float] = []
        segments: list[list[int]] = []
        interruptions = 0
        limit = int(params["max_new_tokens"])
        while True:
            if out.output_ids:
                v = self.engine.segment_version(out, version)
                if segments and segments[-1][0] == v:
                    segments[-1][1] += len(out.output_ids)
                else:
                    segments.append([v, len(out.output_ids)])
                ids += out.output_ids
                logprobs += out.logprobs or []
            if not out.aborted:
                return Sample(ids, logprobs, segments, out.finish_type, now_ms(), interruptions)
            if self.engine.stop.cancelled.is_set():
                raise Stopped
            if swaps == self.engine.swaps:
                raise EngineError(
                    f"engine aborted request {out.rid} without a version change: "
                    f"{out.finish_reason}"
                )
            interruptions += 1
            self.interrupted += 1
            self.metrics.interrupted.labels(self.config.version_policy).inc()
            if self.config.version_policy == "abort":
                ids, logprobs, segments = [], [], []
            remaining = limit - len(ids)
            if remaining <= 0:
                return Sample(ids, logprobs, segments, "length", now_ms(), interruptions)
            rid = f"{rid_prefix}-{interruptions}"
            more = {**params, "max_new_tokens": remaining}
            progress = _after(ids, logprobs, on_tokens)
            outputs, version, swaps = await self._call([prompt_ids + ids], [more], [rid], progress)
            out = outputs[0]

    async def _call(
        self,
        prompts: list[list[int]],
        sampling: list[dict[str, Any]],
        rids: list[str],
        on_tokens: TokenProgress | None = None,
    ) -> tuple[list[GenerateOutput], int, int]:
        outputs, version, swaps = await self.engine.call(prompts, sampling, rids, on_tokens)
        tokens = sum(len(o.output_ids) for o in outputs)
        self.metrics.tokens.inc(tokens)
        self.tokens += tokens
        return outputs, version, swaps
