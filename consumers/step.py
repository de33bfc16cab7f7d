"""One optimiser step: log-probs with gradient, the configured loss, backward, step.

The anchor of the decoupled losses (what ``logp_old`` means to them) is chosen per
record, because a batch can mix records with exact old log-probs and records without:

==================  =========================================================================
record              anchor
==================  =========================================================================
exact ``logp_old``  ``logp_old`` from the stream (training-side numerics at its version)
otherwise, route    ``ewma``: ``logp_prox``, a no-grad forward pass of the proximal model
                    (EWMA of the trainer's past weights, ``consumers.ewma``) in the same
                    batch layout; ``infer``: ``logp_infer`` (d = 1); ``current``: the
                    detached ``logp_new`` (s = 1, a baseline); ``drop``: not trained
==================  =========================================================================

The ``ppo_ewma`` loss anchors on ``logp_prox`` by definition; exact records use their
``logp_old`` there too unless ``approx.exact_for_ppo_ewma`` is off. Losses that do not
anchor on ``logp_old`` (``grpo``, ``mu_grpo`` on the total ratio) ignore the route.

The EWMA is created the first time a batch needs it (θ_prox = the current weights, a
fresh average) and, from then on, updated after every trainer step (one scored batch,
whatever its number of optimiser steps), or reset by its reset rule. ``mismatch/k3_kl`` is always
computed over exact records only (k3 of logp_old − logp_infer), whatever the anchor.

Every loss sees the batch's loss mask: the environment tokens of a multi-turn episode
(tool results the policy conditioned on) carry no gradient and count in no denominator or
token metric; ``tokens/env`` counts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from consumers.batching import PackedBatch, pack, response_logprobs, response_logprobs_entropy
from consumers.config import TrainerConfig
from consumers.ewma import EwmaProximal
from consumers.losses import LossInputs, compute_loss, k3
from consumers.shipped_weights import ShippedRounding
from consumers.train_engine import TrainEngine
from schemas.trajectory import OldLogitsStatus, Trajectory

#: Metrics summed over micro-batches (the others are response-token-weighted means).
_SUMMED = (
    "tokens/response",
    "tokens/env",
    "mis/masked_seqs",
    "veto/catastrophic_seqs",
    "nav/vetoed_seqs",
)


@dataclass(frozen=True)
class StepResult:
    """Loss metrics of one optimiser step (token-weighted over its micro-batches)."""

    metrics: dict[str, float]
    trained: list[Trajectory]
    dropped: int


class StepRunner:
    """Runs optimiser steps on an engine with the configured loss and anchor route."""

    def __init__(self, engine: TrainEngine, config: TrainerConfig, pad_id: int) -> None:
        self.engine = engine
        self.config = config
        self.loss_config = config.loss
        self.pad_id = pad_id
        self.route = config.approx.route if config.needs_old_logp() else "infer"
        self.beta, self.reset_below, self.reset_rule = config.ewma_settings()
        self.ref_model = engine.frozen_copy() if config.loss.kl_coef > 0 else None
        self.prox_model = engine.frozen_copy() if self.route == "ewma" else None
        self.ewma: EwmaProximal | None = None
        self.seed_shift = 0  # moved by a guard's rollback (consumers.guards), per rollback
        self.shipped = (
            ShippedRounding.for_module(engine.module, torch.bfloat16)
            if config.trains_on_shipped_copy()
            else None
        )

    @staticmethod
    def frozen_copies_needed(config: TrainerConfig) -> int:
        """How many frozen copies ``TrainEngine`` must keep for this config."""
        uses_ewma = config.needs_old_logp() and config.approx.route == "ewma"
        return int(config.loss.kl_coef > 0) + int(uses_ewma)

    # --- the step -----------------------------------------------------------------------

    def select(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
        """The records this step can train (route ``drop`` skips non-exact ones)."""
        if self.route != "drop":
            return list(trajectories), 0
        kept = [t for t in trajectories if t.old_logits_status == OldLogitsStatus.EXACT]
        return kept, len(trajectories) - len(kept)

    def train_step(
        self,
        micro_batches: Sequence[Sequence[Trajectory]],
        step: int = 0,
        relaxed: Collection[str] = frozenset(),
        *,
        empty_ok: bool = False,
    ) -> StepResult:
        """Train one scored batch: ``grad_accum_steps`` micro-batches of whole groups.

        With ``[trainer.ppo] epochs = minibatches = 1`` that is one optimiser step over the
        micro-batches as given. Otherwise the batch's trajectories (after ``select``) are
        passed over ``epochs`` times, each pass split into minibatches of
        ``grad_accum_steps`` micro-batches, one optimiser step each. ``step`` seeds the
        per-pass shuffle so a replay of the same step reproduces it. ``relaxed``: ids of
        records past the staleness window, clipped with ``[trainer.staleness]
        relaxed_clip_bounds`` (``over_window = "relaxed_clip"``). ``empty_ok``: a trainer
        rank whose share of a micro-batch is empty runs a zero-gradient micro-step in its
        place, so every rank takes part in every gradient all-reduce (``consumers.ranks``).
        """
        accum = self.engine.config.grad_accum_steps
        if len(micro_batches) != accum:
            raise ValueError(f"{len(micro_batches)} micro-batches for grad_accum_steps={accum}")
        kept_batches: list[list[Trajectory]] = []
        dropped = 0
        for records in micro_batches:
            kept, n_dropped = self.select(records)
            dropped += n_dropped
            if not kept and not empty_ok:
                raise ValueError("a micro-batch with nothing to train (select() it first)")
            kept_batches.append(kept)
        trained = [t for batch in kept_batches for t in batch]
        ppo = self.config.ppo
        if ppo.optimizer_steps() == 1:
            plan = [kept_batches]
        else:
            plan = minibatch_plan(
                trained,
                ppo.epochs,
                ppo.minibatches,
                accum,
                ppo.shuffle,
                seed=(self.config.engine.seed + self.seed_shift) * 1_000_003 + step,
            )
        parts: list[dict[str, float]] = []
        grad_norms: list[float] = []
        for minibatch in plan:
            boundary = False
            for records in minibatch:
                if not records:
                    self._idle_micro_step()
                    boundary = self.engine.step()
                    continue
                packed = pack(records).to(self.engine.device)
                rows = [t.trajectory_id in relaxed for t in records] if relaxed else None
                with self.shipped.applied() if self.shipped else contextlib.nullcontext():
                    parts.append(self._micro_step(packed, rows))
                boundary = self.engine.step()  # DeepSpeed steps the optimiser on the last
            if not boundary:
                raise RuntimeError("DeepSpeed did not step the optimiser at a minibatch's end")
            grad_norm = self.engine.grad_norm()
            if grad_norm is not None:
                grad_norms.append(grad_norm)
        metrics = combine_metrics(parts) if parts else {}
        for name in _SUMMED:  # every pass sees the same tokens: report them once
            if name in metrics:
                metrics[name] /= ppo.epochs
        if grad_norms:
            metrics["grad/norm"] = grad_norms[-1]
            metrics["grad/norm_max"] = max(grad_norms)
        metrics["ppo/optimizer_steps"] = float(len(plan))
        metrics["optim/lr"] = self.engine.lr()
        self._after_optimizer_step(metrics)
        return StepResult(metrics=metrics, trained=trained, dropped=dropped)

    def _micro_step(
        self, batch: PackedBatch, relaxed: list[bool] | None = None
    ) -> dict[str, float]:
        logp_new, entropy = response_logprobs_entropy(  # through DeepSpeed
            self.engine.engine, batch, temperature=self.config.model.temperature, pad_id=self.pad_id
        )
        logp_prox = self._logp_prox(batch) if needs_prox(self.config, batch) else None
        logp_ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                logp_ref = self._logp(self.ref_model, batch)
        inputs, anchored_on_prox = anchored_inputs(
            self.config, batch, logp_new, logp_prox=logp_prox, logp_ref=logp_ref
        )
        if relaxed is not None and any(relaxed):
            inputs = dataclasses.replace(
                inputs,
                relaxed=torch.tensor(relaxed, device=self.engine.device),
                relaxed_bounds=self.config.staleness.relaxed_clip_bounds,
            )
        out = compute_loss(self.loss_config, inputs)
        self.engine.backward(out.loss)
        metrics = step_metrics(out.metrics, batch, anchored_on_prox, logp_new)
        trained = batch.loss_mask
        metrics["policy/entropy"] = float((entropy * trained).sum()) / max(int(trained.sum()), 1)
        return metrics

    def _idle_micro_step(self) -> None:
        """A backward of a zero loss over every trainable parameter: zero gradients that
        still take part in DeepSpeed's reductions."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        self.engine.backward(torch.stack([p.sum() for p in params]).sum() * 0.0)

    def _logp(self, model: Any, batch: PackedBatch) -> torch.Tensor:
        return response_logprobs(
            model, batch, temperature=self.config.model.temperature, pad_id=self.pad_id
        )

    # --- EWMA proximal policy -----------------------------------------------------------

    def _logp_prox(self, batch: PackedBatch) -> torch.Tensor:
        assert self.prox_model is not None
        if self.ewma is None:
            self.ewma = EwmaProximal(self.engine.module.state_dict(), self.beta)
            self.prox_model.load_state_dict(self.ewma.proximal_state_dict())
        with torch.no_grad():
            return self._logp(self.prox_model, batch)

    def _after_optimizer_step(self, metrics: dict[str, float]) -> None:
        if self.ewma is None or self.prox_model is None:
            return
        state = self.engine.module.state_dict()
        kept = metrics.get("train_infer/kept_frac")
        if kept is not None and self.ewma.observe_kept(kept, self.reset_below, self.reset_rule):
            self.ewma.reset(state)
            metrics["ewma/reset"] = 1.0
        else:
            self.ewma.update(state)
            metrics["ewma/reset"] = 0.0
        metrics["ewma/weight"] = self.ewma.weight
        self.prox_model.load_state_dict(self.ewma.proximal_state_dict())

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep besides the engine (the EWMA, if any)."""
        return {"ewma": None if self.ewma is None else self.ewma.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("ewma")
        if saved is None or self.prox_model is None:
            self.ewma = None
            return
        self.ewma = EwmaProximal(self.engine.module.state_dict(), self.beta)
        self.ewma.load_state_dict(saved)
        self.prox_model.load_state_dict(self.ewma.proximal_state_dict())


# --- the anchor route as plain functions (also used by ``rollstream replay --rerun train``) --


def minibatch_plan(
    records: Sequence[Trajectory],
    epochs: int,
    minibatches: int,
    grad_accum_steps: int,
    shuffle: bool,
    seed: int,
) -> list[list[list[Trajectory]]]:
    """The optimiser steps of one scored batch: ``epochs`` passes, each split into
    minibatches of ``grad_accum_steps`` non-empty micro-batches.

    Advantages are already on the records, so a group may span minibatches. With fewer
    records than ``minibatches x grad_accum_steps`` a pass takes fewer minibatches.
    """
    per_pass = max(1, min(minibatches, len(records) // grad_accum_steps))
    rng = random.Random(seed)
    plan: list[list[list[Trajectory]]] = []
    for _ in range(epochs):
        order = list(records)
        if shuffle:
            rng.shuffle(order)
        for chunk in _split(order, per_pass):
            plan.append(_split(chunk, grad_accum_steps))
    return plan


def _split(items: Sequence[Trajectory], parts: int) -> list[list[Trajectory]]:
    """``parts`` contiguous slices whose sizes differ by at most one (all non-empty when
    there are at least ``parts`` items)."""
    size, extra = divmod(len(items), parts)
    out: list[list[Trajectory]] = []
    start = 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def needs_prox(config: TrainerConfig, batch: PackedBatch) -> bool:
    """Whether this micro-batch needs ``logp_prox`` (a forward pass of the EWMA model)."""
    route = config.approx.route if config.needs_old_logp() else "infer"
    return route == "ewma" and (
        bool((~batch.old_exact).any())
        or (config.loss.type == "ppo_ewma" and not config.approx.exact_for_ppo_ewma)
    )


def anchored_inputs(
    config: TrainerConfig,
    batch: PackedBatch,
    logp_new: torch.Tensor,
    *,
    logp_prox: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
) -> tuple[LossInputs, torch.Tensor | None]:
    """The loss inputs of one micro-batch, each record anchored as the module doc says,
    and the ``[B, 1]`` rows anchored on ``logp_prox`` (None when the route never does)."""
    uses_anchor = config.needs_old_logp()
    route = config.approx.route if uses_anchor else "infer"
    is_ppo_ewma = config.loss.type == "ppo_ewma"
    exact = batch.old_exact[:, None]
    fallback = logp_prox if logp_prox is not None else batch.logp_infer
    if route == "current" and not is_ppo_ewma:
        # the weights being trained, before this step's update when a batch is one
        # optimiser step: the anchor of a pipeline that recomputes lost old logits
        fallback = logp_new.detach()
    logp_old = None
    anchored_on_prox = None
    if is_ppo_ewma:
        use_exact = exact & config.approx.exact_for_ppo_ewma
        logp_prox = torch.where(use_exact, batch.logp_old, fallback)
        anchored_on_prox = ~use_exact
    elif uses_anchor:
        logp_old = torch.where(exact, batch.logp_old, fallback)
        anchored_on_prox = ~exact if route == "ewma" else None
    inputs = LossInputs(
        logp_new=logp_new,
        logp_old=logp_old,
        logp_infer=batch.logp_infer,
        advantages=batch.advantages,
        mask=batch.loss_mask,
        logp_ref=logp_ref,
        logp_prox=logp_prox if is_ppo_ewma else None,
    )
    return inputs, anchored_on_prox


def step_metrics(
    loss_metrics: dict[str, float],
    batch: PackedBatch,
    anchored_on_prox: torch.Tensor | None,
    logp_new: torch.Tensor | None = None,
) -> dict[str, float]:
    """The loss's metrics with ``mismatch/k3_kl`` and ``mismatch/abs_log_d/{mean,max}``
    (|log d| = |logp_old − logp_infer| per policy token) over exact records only, plus the
    fractions of exact and proximal-anchored tokens (policy tokens, like the loss) and the
    number of environment tokens left out of the loss. With ``logp_new``: how far the
    weights being trained are from the policy that generated the data
    (``offpolicy/k3_kl``, KL(generating ‖ trained) by the k3 estimator, and
    ``offpolicy/abs_log_ratio``, the mean |log π_θ − log π_gen|, per policy token; the
    generating policy's log-probs are the exact old ones where recorded, the engine's
    otherwise): the measure of how off-policy a fork trains."""
    metrics = dict(loss_metrics)
    metrics.pop("mismatch/k3_kl", None)
    exact = batch.old_exact[:, None]
    with torch.no_grad():
        trained = batch.loss_mask
        n_trained = max(int(trained.sum()), 1)
        exact_mask = trained & exact
        n_exact = int(exact_mask.sum())
        if n_exact:
            log_d = torch.where(exact_mask, batch.logp_old - batch.logp_infer, 0.0)
            metrics["mismatch/k3_kl"] = float(k3(log_d).sum()) / n_exact
            metrics["mismatch/abs_log_d/mean"] = float(log_d.abs().sum()) / n_exact
            metrics["mismatch/abs_log_d/max"] = float(log_d.abs().max())
        metrics["data/exact_old_frac"] = n_exact / n_trained
        if logp_new is not None:
            generating = torch.where(exact, batch.logp_old, batch.logp_infer)
            log_r = torch.where(trained, logp_new.detach() - generating, 0.0)
            metrics["offpolicy/k3_kl"] = float(k3(log_r).sum()) / n_trained
            metrics["offpolicy/abs_log_ratio"] = float(log_r.abs().sum()) / n_trained
        if anchored_on_prox is not None:
            n_prox = int((trained & anchored_on_prox).sum())
            metrics["data/anchor_prox_frac"] = n_prox / n_trained
        metrics["tokens/env"] = float((batch.response_mask & ~trained).sum())
    return metrics


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Sum counts, max maxima, response-token-weighted means for everything else."""
    if len(parts) == 1:
        return dict(parts[0])
    weights = [max(p.get("tokens/response", 0.0), 0.0) for p in parts]
    names = sorted({name for p in parts for name in p})
    out: dict[str, float] = {}
    for name in names:
        present = [(p[name], w) for p, w in zip(parts, weights, strict=True) if name in p]
        values = [v for v, _ in present]
        if name in _SUMMED:
            out[name] = float(sum(values))
        elif name.endswith("/max"):
            out[name] = float(max(values))
        else:
            weight = sum(w for _, w in present)
            if weight > 0:
                out[name] = float(sum(v * w for v, w in present) / weight)
            else:
                out[name] = float(sum(values) / len(values))
    return out
