"""Exact old log-probs: each response token scored under the version that generated it.

A trajectory's response is a sequence of segments ``(version v_k, length n_k)`` (a
partial rollout spans versions). Its ``logp_old`` is assembled per segment: the tokens of
segment ``k`` come from one forward pass of ``prompt + response[:end_k]`` under θ_{v_k}
(causal attention: tokens after ``end_k`` cannot change them, so they are left out). The
work units of a batch of trajectories are grouped by version, so each version's weights
are fetched once and its units run as a few padded batches (at most
``max_batch_sequences`` rows and ``max_batch_tokens`` padded tokens each), in input
order, through ``core.logprobs.response_logprobs`` — the trainer's function.

A multi-turn episode goes through the same passes (environment turns are part of the
context the policy conditioned on), then its environment positions are set to exactly
``0.0``: nobody sampled those tokens, and the wire format promises ``0.0`` there.

A trajectory gets ``logp_old`` only when *every* one of its versions is available; if one
is not (never published, deleted from S3, refused), it is marked
``old_logits_status="missing"`` and the trainer takes its approximate route (PPO-EWMA).
With ``mode="off"`` nothing is computed and records are marked ``"off"``.

``compute`` is blocking work (on ``[streams.old_logits] device``): the stream calls it in
a single-thread executor, never on the event loop. It is not reentrant (one module,
parameters swapped per call).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.config import LoraConfig
from core.devices import resolve_device
from core.logprobs import response_logprobs
from core.models import build_tiny_llama, load_model, model_directory, parse_model_spec
from schemas.trajectory import OldLogitsStatus, Trajectory
from streams.config import OldLogitsConfig
from streams.metrics import StreamMetrics
from streams.snapshots import SnapshotSource, SnapshotStore, snapshot_store_for

if TYPE_CHECKING:
    import torch


def model_limits(spec: str, cache_dir: Path | None = None) -> tuple[int, int]:
    """``(vocab_size, context_length)`` of the model ``spec`` names, without loading its
    weights: the tiny model's from its spec and ``build_tiny_llama``'s defaults, a
    checkpoint's from its ``config.json``. A record with a token id outside the vocabulary
    or more tokens than the context cannot be scored by the old-logit pass."""
    parsed = parse_model_spec(spec)
    if parsed.is_tiny:
        defaults = {
            name: p.default for name, p in inspect.signature(build_tiny_llama).parameters.items()
        }
        options = {**defaults, **parsed.tiny_kwargs}
        return int(options["vocab_size"]), int(options["max_positions"])
    directory = model_directory(parsed, cache_dir)
    assert directory is not None
    config = json.loads((directory / "config.json").read_text())
    config = config.get("text_config", config)  # multimodal checkpoints nest the LM's
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 1 << 30))


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    """One segment of one trajectory: response tokens ``[start, end)`` under ``version``."""

    row: int
    version: int
    start: int
    end: int


def segment_units(trajectories: Sequence[Trajectory]) -> list[Unit]:
    """Every segment of every trajectory, in input order."""
    units: list[Unit] = []
    for row, traj in enumerate(trajectories):
        start = 0
        for version, length in zip(
            traj.segment_versions.tolist(), traj.segment_lengths.tolist(), strict=True
        ):
            units.append(Unit(row, int(version), start, start + int(length)))
            start += int(length)
    return units


def plan_batches(
    units: Sequence[Unit],
    trajectories: Sequence[Trajectory],
    max_sequences: int,
    max_tokens: int,
) -> list[list[Unit]]:
    """Consecutive runs of ``units`` (one version) within the batch limits.

    A batch's padded size is rows x (longest prompt + response prefix); a unit too long to
    share a batch runs alone.
    """
    batches: list[list[Unit]] = []
    current: list[Unit] = []
    width = 0
    for unit in units:
        length = trajectories[unit.row].num_prompt_tokens + unit.end
        new_width = max(width, length)
        if current and (
            len(current) + 1 > max_sequences or new_width * (len(current) + 1) > max_tokens
        ):
            batches.append(current)
            current, new_width = [], length
        current.append(unit)
        width = new_width
    if current:
        batches.append(current)
    return batches


@dataclasses.dataclass(frozen=True, slots=True)
class OldLogits:
    """What ``compute`` found for one trajectory."""

    logp_old: np.ndarray | None
    status: str
    missing_versions: tuple[int, ...] = ()


class OldLogitEngine:
    """Computes and attaches ``logp_old`` for batches of trajectories."""

    def __init__(
        self,
        config: OldLogitsConfig,
        snapshots: SnapshotStore | None,
        model: Any = None,
        metrics: StreamMetrics | None = None,
        cache_dir: Path | None = None,
        device: torch.device | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        self.config = config
        self.cache_dir = cache_dir
        self.lora = lora
        self.snapshots = snapshots
        self.metrics = metrics if metrics is not None else StreamMetrics()
        self._model = model
        self._dtype: torch.dtype | None = None
        self._device = device

    @property
    def device(self) -> torch.device:
        """Where the pass runs: ``device`` as given (the worker resolves it once for the
        engine and its snapshot store), else ``config.device`` resolved here."""
        if self._device is None:
            self._device = resolve_device(self.config.device)
        return self._device

    @property
    def model(self) -> Any:
        """The module the versions' weights run through: ``config.model`` loaded by
        ``core.models.load_model`` (the trainer's and the engine's loader) in
        ``config.dtype`` on ``device``. Its own weights are never used: every forward pass
        supplies a version's state dict, and every tensor of the pass is created on the
        model's device (``core.logprobs``); the values come back as CPU arrays."""
        if self._model is None:
            self._model = load_model(
                self.config.model,
                self.config.dtype,
                self.device,
                cache_dir=self.cache_dir,
                lora=self.lora,
            )
        return self._model

    @property
    def dtype(self) -> torch.dtype:
        if self._dtype is None:
            import torch

            self._dtype = getattr(torch, self.config.dtype)
        return self._dtype

    def compute(self, trajectories: Sequence[Trajectory]) -> list[OldLogits]:
        """``logp_old`` (or why not) for each trajectory, in order. Blocking."""
        if self.config.mode == "off" or self.snapshots is None:
            status = OldLogitsStatus.OFF if self.config.mode == "off" else OldLogitsStatus.MISSING
            return [OldLogits(None, status.value) for _ in trajectories]
        units = segment_units(trajectories)
        states: dict[int, Any] = {}
        for version in sorted({u.version for u in units}):
            states[version] = self.snapshots.get(version)
        missing: dict[int, set[int]] = defaultdict(set)
        for unit in units:
            if states[unit.version] is None:
                missing[unit.row].add(unit.version)
        runnable = [u for u in units if u.row not in missing]
        by_version: dict[int, list[Unit]] = defaultdict(list)
        for unit in runnable:
            by_version[unit.version].append(unit)

        out = [np.empty(t.num_response_tokens, np.float32) for t in trajectories]
        tokens = 0
        started = time.perf_counter()
        for version in sorted(by_version):
            for batch in plan_batches(
                by_version[version],
                trajectories,
                self.config.max_batch_sequences,
                self.config.max_batch_tokens,
            ):
                pairs = [
                    (trajectories[u.row].prompt_ids, trajectories[u.row].response_ids[: u.end])
                    for u in batch
                ]
                values = response_logprobs(
                    self.model,
                    pairs,
                    self.dtype,
                    temperature=self.config.temperature,
                    state=states[version],
                )
                for unit, logp in zip(batch, values, strict=True):
                    out[unit.row][unit.start : unit.end] = logp[unit.start : unit.end]
                    tokens += unit.end - unit.start
        seconds = time.perf_counter() - started
        if tokens:
            self.metrics.oldlogit_tokens.inc(tokens)
            self.metrics.oldlogit_seconds.inc(seconds)
            self.metrics.oldlogit_rate.set(tokens / max(seconds, 1e-9))

        results = []
        for row, traj in enumerate(trajectories):
            if traj.turn_kinds is not None and row not in missing:
                out[row][~traj.loss_mask] = 0.0
            if row in missing:
                results.append(
                    OldLogits(None, OldLogitsStatus.MISSING.value, tuple(sorted(missing[row])))
                )
            else:
                results.append(OldLogits(out[row], OldLogitsStatus.EXACT.value))
        return results

    def attach(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """Copies of ``trajectories`` carrying ``logp_old`` and its status. Blocking."""
        attached = []
        for traj, found in zip(trajectories, self.compute(trajectories), strict=True):
            self.metrics.oldlogit_status.labels(status=found.status).inc()
            if found.logp_old is not None:
                attached.append(traj.with_old_logits(found.logp_old, found.status))
            else:
                attached.append(
                    dataclasses.replace(traj, logp_old=None, old_logits_status=found.status)
                )
        return attached


def old_logit_engine_for(
    config: OldLogitsConfig,
    source: SnapshotSource | None,
    *,
    metrics: StreamMetrics | None = None,
    cache_dir: Path | None = None,
    lora: LoraConfig | None = None,
) -> OldLogitEngine:
    """The engine and its snapshot store as the stream worker runs them: ``config.device``
    resolved once, for the model and the versions alike; a LoRA run's model carries the
    adapter, so its versions (base and adapter) run through PEFT's own layers, as the
    trainer's do."""
    device = resolve_device(config.device)
    snapshots = snapshot_store_for(config, source, device, metrics)
    return OldLogitEngine(
        config, snapshots, metrics=metrics, cache_dir=cache_dir, device=device, lora=lora
    )
