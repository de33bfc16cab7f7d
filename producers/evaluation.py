"""``rollstream eval``: the task's held-out eval split, generated and scored every N versions.

An evaluator follows the run's weights as a producer does, but it publishes nothing to
``rollouts.raw``: what it generates is never trained on. Each version that is a multiple
of ``producers.eval.every_versions`` is loaded into the evaluator's own engine (nothing
else changes that engine's weights, and every completion is checked to come from that
version), the eval prompts are generated (``samples_per_prompt`` each, greedy by
default), scored with the task's own reward functions, and one row is appended to the
metrics file: ``{"step": v, "version": v, "eval/reward/mean": ..., ...}``. A version is
the trainer's step count when it was published, so ``rollstream report`` draws eval beside
training on one axis.

When versions arrive faster than an evaluation takes, the newest due version is
evaluated next and the ones passed over are logged. A restarted evaluator skips the
versions its metrics file already holds.

``evaluate_stored`` measures the versions a weight store already holds instead, and
ends: a finished run's, or a fork's (whose versions are never announced), so that
``rollstream report`` can put each arm's held-out reward side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from core.config import SharedConfig
from core.tracking import Tracker
from producers.config import EvalConfig, ProducersConfig
from producers.engine.backends import Backend
from producers.engine.client import GenerateOutput
from producers.rollout.publishing import task_scores
from producers.tasks.base import Prompt, Task

logger = logging.getLogger(__name__)


class EvalError(RuntimeError):
    """The engine answered with something other than the version being measured."""


def eval_metrics_path(config: SharedConfig, producers: ProducersConfig) -> Path:
    """The configured metrics file, else ``<state_dir>/eval/<run>[/<policy>]/metrics.jsonl``."""
    if producers.eval.metrics_file is not None:
        return Path(producers.eval.metrics_file)
    return EvalConfig.default_metrics_file(config.state_dir, config.run_id, config.policy)


def evaluated_versions(path: Path) -> set[int]:
    """Versions the metrics file already holds (a torn last line is ignored)."""
    if not path.is_file():
        return set()
    done = set()
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            row = orjson.loads(line)
            if isinstance(row, dict) and isinstance(row.get("version"), int):
                done.add(row["version"])
    return done


@dataclass
class DueVersions:
    """The newest version due for evaluation, handed over by the follower's thread."""

    every: int
    done: set[int]
    loop: asyncio.AbstractEventLoop
    arrived: asyncio.Event
    _latest: tuple[int, Mapping[str, Any]] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit_version(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """The follower's callback (its thread): keep the version if it is due."""
        if version % self.every or version in self.done:
            return
        with self._lock:
            if self._latest is not None and self._latest[0] >= version:
                return
            passed = self._latest
            self._latest = (version, state_dict)
        if passed is not None:
            logger.warning(
                "version %d arrived before v%d was evaluated: v%d skipped",
                version,
                passed[0],
                passed[0],
            )
        self.loop.call_soon_threadsafe(self.arrived.set)

    def take(self) -> tuple[int, Mapping[str, Any]] | None:
        with self._lock:
            latest, self._latest = self._latest, None
        return latest


def summarize(
    version: int, scores: Sequence[Any], outputs: Sequence[GenerateOutput], prompts: int
) -> dict[str, Any]:
    """The metrics row of one evaluated version."""
    rewards = [s.reward for s in scores]
    mean = sum(rewards) / len(rewards)
    row: dict[str, Any] = {
        "step": version,
        "version": version,
        "eval/prompts": prompts,
        "eval/samples": len(rewards),
        "eval/reward/mean": mean,
        "eval/reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "eval/response_length/mean": sum(len(o.output_ids) for o in outputs) / len(outputs),
        "eval/truncated_frac": sum(o.finish_type == "length" for o in outputs) / len(outputs),
    }
    per_function: dict[str, list[float]] = {}
    for score in scores:
        for name, value in (score.details.get("rewards") or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                per_function.setdefault(str(name), []).append(float(value))
    for name, values in sorted(per_function.items()):
        row[f"eval/fn/{name}"] = sum(values) / len(values)
    flags: dict[str, list[bool]] = {}
    for score in scores:  # what the reward is made of, as the trainer's reward/<key>_frac
        for name, value in score.details.items():
            if (
                isinstance(value, bool)
                and name != "reward_failed"
                and (name in flags or len(flags) < 16)
            ):
                flags.setdefault(str(name), []).append(value)
    for name, values in sorted(flags.items()):
        row[f"eval/reward/{name}_frac"] = sum(values) / len(values)
    failed = sum(bool(s.details.get("reward_failed")) for s in scores)
    if failed:
        row["eval/reward_failed_frac"] = failed / len(scores)
    return row


class Evaluator:
    """Generates and scores the eval prompts at one version on its own engine."""

    def __init__(
        self,
        backend: Backend,
        task: Task,
        prompts: Sequence[Prompt],
        params: dict[str, Any],
        samples: int,
    ) -> None:
        self.backend = backend
        self.task = task
        self.prompts = list(prompts)
        self.params = params
        self.samples = samples

    async def evaluate(self, version: int, state_dict: Mapping[str, Any] | None) -> dict[str, Any]:
        """Load ``version`` (``None``: the engine already serves it) and measure it."""
        began = time.monotonic()
        if state_dict is not None:
            await self.backend.load_version(version, state_dict)
        n = self.samples
        batch = [p.ids for p in self.prompts for _ in range(n)]
        rids = [f"eval-v{version}-{i}-{j}" for i in range(len(self.prompts)) for j in range(n)]
        outputs = await self.backend.generate(batch, [self.params] * len(batch), rids)
        wrong = {o.weight_version for o in outputs if o.weight_version != str(version)}
        if wrong or any(o.aborted for o in outputs):
            raise EvalError(
                f"evaluating v{version}: the engine answered with versions "
                f"{sorted(map(str, wrong))} or aborted; is another client updating its weights?"
            )
        scores = []
        for i, prompt in enumerate(self.prompts):
            responses = [list(o.output_ids) for o in outputs[i * n : (i + 1) * n]]
            scores += await task_scores(self.task, prompt, responses)
        row = summarize(version, scores, outputs, len(self.prompts))
        row["eval/seconds"] = time.monotonic() - began
        return row


@dataclass
class EvalSession:
    """An evaluator, the metrics file its rows go to (and the versions it holds), and the
    tracker they are logged to."""

    evaluator: Evaluator
    path: Path
    done: set[int]
    tracker: Tracker

    async def measure(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Evaluate ``version`` and record its row."""
        row = await self.evaluator.evaluate(version, state_dict)
        with self.path.open("ab") as fh:
            fh.write(orjson.dumps(row) + b"\n")
        self.tracker.log(row, version)
        self.done.add(version)
        logger.info(
            "v%d: eval reward %.4f over %d sample(s) in %.1fs",
            version,
            row["eval/reward/mean"],
            row["eval/samples"],
            row["eval/seconds"],
        )


async def open_session(
    config: SharedConfig, producers: ProducersConfig, stack: contextlib.AsyncExitStack
) -> EvalSession:
    """The engine (closed by ``stack``), the task's eval prompts and the metrics file."""
    from producers.engine.backends import http_backend, local_backend
    from producers.tasks.base import TaskContext
    from producers.tasks.catalog import make_task

    settings = producers.eval
    rollout = producers.rollout
    path = eval_metrics_path(config, producers)
    path.parent.mkdir(parents=True, exist_ok=True)
    backend: Backend
    if settings.engine_url:
        own = rollout.model_copy(update={"engine_url": settings.engine_url})
        weights_dir = path.parent / "weights"
        remote = await http_backend(
            own, producers.engine, weights_dir, config.cache_dir, config.lora
        )
        tokenizer, backend = remote.tokenizer, remote
    else:
        local = await local_backend(producers.engine, config.cache_dir, rollout.initial_version)
        tokenizer, backend = local.engine.tokenizer, local
    stack.push_async_callback(backend.aclose)
    task = make_task(rollout.task, rollout.task_options, TaskContext(config.cache_dir, tokenizer))
    eval_prompts = getattr(task, "eval_prompts", None)
    if eval_prompts is None:
        raise ValueError(f"task {rollout.task!r} has no eval split to evaluate")
    prompts = eval_prompts()[: settings.max_prompts]
    sampling = rollout.sampling.model_copy(update={"temperature": settings.temperature})
    params = sampling.to_sglang(task.max_new_tokens, task.stop_token_ids)
    evaluator = Evaluator(backend, task, prompts, params, settings.samples_per_prompt)
    tracker = Tracker.for_role(config, "eval")
    stack.callback(tracker.close)
    logger.info(
        "evaluating %d prompt(s) x %d of run %s into %s",
        len(prompts),
        settings.samples_per_prompt,
        config.run_id,
        path,
    )
    return EvalSession(evaluator, path, evaluated_versions(path), tracker)


async def run_evaluator(
    config: SharedConfig,
    producers: ProducersConfig,
    stop: threading.Event,
    max_evaluations: int | None = None,
) -> int:
    """Evaluate due versions as the run publishes them until ``stop`` is set (or
    ``max_evaluations`` are done); returns how many were evaluated."""
    from producers.rollout.versions import start_follower

    every = producers.eval.every_versions
    if every < 1:
        raise ValueError("producers.eval.every_versions must be at least 1 to evaluate")
    count = 0
    async with contextlib.AsyncExitStack() as stack:
        session = await open_session(config, producers, stack)
        due = DueVersions(every, session.done, asyncio.get_running_loop(), asyncio.Event())
        following = threading.Event()
        follower = start_follower(config, due, following)
        stack.callback(follower.listener.close)
        stack.push_async_callback(follower.join)
        stack.callback(following.set)
        while not stop.is_set() and (max_evaluations is None or count < max_evaluations):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(due.arrived.wait(), timeout=0.5)
            due.arrived.clear()
            taken = due.take()
            if taken is not None:
                await session.measure(*taken)
                count += 1
    return count


def stored_due(
    stored: Sequence[int], every: int, done: set[int], versions: Sequence[int] | None
) -> list[int]:
    """The stored versions to evaluate, oldest first: ``versions`` (each must be stored),
    else every multiple of ``every`` (every one, ``every`` 0: a fork's lineage measured
    without an eval schedule); those ``done`` already are left out."""
    if versions is not None:
        missing = sorted(set(versions) - set(stored))
        if missing:
            raise ValueError(f"the weight store holds no version {missing} (it holds {stored})")
        wanted = set(versions)
    else:
        wanted = {v for v in stored if every < 1 or v % every == 0}
    return sorted(wanted - done)


async def evaluate_stored(
    config: SharedConfig,
    producers: ProducersConfig,
    versions: Sequence[int] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Evaluate the versions the run's weight store holds now (a finished run, a fork's
    lineage, whose versions are not announced), oldest first, each rebuilt and verified as
    a follower does; returns how many were evaluated."""
    from weights.follower import WeightFollower
    from weights.store import WeightStore

    store = WeightStore.from_config(config.s3, config.run_id, config.policy)
    stored = await asyncio.to_thread(store.versions)
    count = 0
    async with contextlib.AsyncExitStack() as stack:
        session = await open_session(config, producers, stack)
        due = stored_due(stored, producers.eval.every_versions, session.done, versions)
        follower = WeightFollower.from_config(store, config.weights)
        for version in due:
            if stop is not None and stop.is_set():
                break
            snapshot = await asyncio.to_thread(
                follower.sync_with_retry, version, give_up_after_s=config.weights.retry_max_s
            )
            if snapshot is None or snapshot.version != version:
                raise EvalError(f"the weight store gave no v{version} of run {config.run_id}")
            await session.measure(version, snapshot.state)
            count += 1
    return count
