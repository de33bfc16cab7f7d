"""PPO-EWMA proximal weights: the approximate route when exact ``logp_old`` is missing.

When exact ``logp_old`` is missing, the decoupled loss is anchored on a proximal policy
whose weights are an exponentially weighted moving average of the trainer's past weights.
With a running weight ``W`` and decay ``β``, after each optimiser step (weights ``θ``)::

    W'      = β·W + 1
    θ_prox ← (β·W / W')·θ_prox + θ / W'

so ``θ_prox`` is the normalised average ``Σ_k β^k θ_{n-k} / Σ_k β^k`` over the steps since
the last reset. ``reset(θ)`` (and construction) sets ``θ_prox ← θ`` and ``W ← 1``: the
current weights become the first and only term of a fresh average. ``β = 0`` makes
``θ_prox`` follow ``θ`` exactly.

Automatic reset, from the fraction of tokens the train-inference correction keeps
(``train_infer/kept_frac`` from ``consumers.losses``, the train-inference mask), by one of
two rules:

- ``below``: reset when the fraction is strictly below ``reset_below``. Under a tight MIS
  band the fraction sits below any fixed threshold at every step, so this rule resets every
  step and θ_prox degenerates into the current weights.
- ``drop`` (default): reset when the fraction is strictly below ``reset_below`` times its
  own running level (an EWMA of past fractions with decay ``KEPT_LEVEL_DECAY``): a sudden
  fall, whatever the band. With a wide band (fractions near 1) it acts like ``below``.

Typical step::

    out = compute_loss(config, inputs)          # logp_prox from a model holding θ_prox
    out.loss.backward(); optimiser.step()
    if ewma.observe_kept(out.metrics["train_infer/kept_frac"], config.reset_below, "drop"):
        ewma.reset(model.state_dict())
    else:
        ewma.update(model.state_dict())
    prox_model.load_state_dict(ewma.proximal_state_dict())

Precision: floating-point entries are accumulated in float32 whatever their dtype (bf16
weights would otherwise lose most small updates to rounding); ``proximal_state_dict()``
casts back to each entry's original dtype. Non-floating entries (integer buffers such as
step counters) are not averaged: they take the latest value. The copy lives on the device
of the tensors it was built from (pass ``device=`` to keep it elsewhere, e.g. on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["KEPT_LEVEL_DECAY", "EwmaProximal", "should_reset"]

#: Decay of the running level of ``train_infer/kept_frac`` the ``drop`` reset rule compares to.
KEPT_LEVEL_DECAY = 0.9


def should_reset(kept_fraction: float, threshold: float | None) -> bool:
    """True when ``kept_fraction`` (in [0, 1]) is strictly below ``threshold``.

    ``threshold=None`` disables automatic resets. NaN or out-of-range fractions raise:
    they mean the metric is broken, and silently resetting (or not) would hide that.
    """
    if math.isnan(kept_fraction) or not 0.0 <= kept_fraction <= 1.0:
        raise ValueError(f"kept_fraction must be in [0, 1], got {kept_fraction}")
    return threshold is not None and kept_fraction < threshold


class EwmaProximal:
    """An EWMA copy of a model's state dict (see the module doc for the update rule)."""

    def __init__(
        self, state: Mapping[str, Tensor], beta: float, device: torch.device | str | None = None
    ) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.beta = beta
        self.device = None if device is None else torch.device(device)
        self.weight = 1.0
        self.num_updates = 0
        self.num_resets = 0
        self.kept_level: float | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self._params: dict[str, Tensor] = {}
        self._copy_from(state)

    def _copy_from(self, state: Mapping[str, Tensor]) -> None:
        self._dtypes = {name: t.dtype for name, t in state.items()}
        self._params = {}
        for name, t in state.items():
            self._params[name] = t.detach().to(
                device=self.device if self.device is not None else t.device,
                dtype=torch.float32 if t.is_floating_point() else t.dtype,
                copy=True,
            )

    def _check_keys(self, state: Mapping[str, Tensor]) -> None:
        if state.keys() != self._params.keys():
            missing = sorted(self._params.keys() - state.keys())
            extra = sorted(state.keys() - self._params.keys())
            raise KeyError(f"state dict keys differ: missing {missing}, unexpected {extra}")
        for name, t in state.items():
            if t.shape != self._params[name].shape:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} != {tuple(self._params[name].shape)}"
                )

    @torch.no_grad()
    def update(self, state: Mapping[str, Tensor]) -> None:
        """Fold the current weights in: ``W' = βW + 1``, ``θ_prox ← (βW/W')θ_prox + θ/W'``."""
        self._check_keys(state)
        new_weight = self.beta * self.weight + 1.0
        keep = self.beta * self.weight / new_weight
        for name, t in state.items():
            prox = self._params[name]
            value = t.detach().to(prox.device)
            if prox.is_floating_point():
                prox.mul_(keep).add_(value.float(), alpha=1.0 / new_weight)
            else:
                prox.copy_(value)
        self.weight = new_weight
        self.num_updates += 1

    @torch.no_grad()
    def reset(self, state: Mapping[str, Tensor]) -> None:
        """``θ_prox ← θ``, ``W ← 1``."""
        self._check_keys(state)
        self._copy_from(state)
        self.weight = 1.0
        self.num_resets += 1

    @staticmethod
    def should_reset(kept_fraction: float, threshold: float | None) -> bool:
        """See the module-level ``should_reset``."""
        return should_reset(kept_fraction, threshold)

    def observe_kept(
        self, kept_fraction: float, threshold: float | None, rule: str = "drop"
    ) -> bool:
        """Whether this step's kept fraction calls for a reset under ``rule`` (``below`` or
        ``drop``, see the module doc); also folds the fraction into the running level."""
        level = self.kept_level if self.kept_level is not None else kept_fraction
        if rule == "below":
            reset = should_reset(kept_fraction, threshold)
        elif rule == "drop":
            reset = should_reset(kept_fraction, None if threshold is None else threshold * level)
        else:
            raise ValueError(f"unknown reset rule {rule!r} (below | drop)")
        self.kept_level = KEPT_LEVEL_DECAY * level + (1.0 - KEPT_LEVEL_DECAY) * kept_fraction
        return reset

    def proximal_state_dict(self) -> dict[str, Tensor]:
        """θ_prox in each entry's original dtype, ready for ``model.load_state_dict``."""
        return {name: p.to(self._dtypes[name]) for name, p in self._params.items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (float32 accumulators, not the cast-back copy)."""
        return {
            "beta": self.beta,
            "weight": self.weight,
            "num_updates": self.num_updates,
            "num_resets": self.num_resets,
            "kept_level": self.kept_level,
            "dtypes": {
                name: str(dtype).removeprefix("torch.") for name, dtype in self._dtypes.items()
            },
            "params": {name: p.clone() for name, p in self._params.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()``; the decay must match the configured one."""
        if state["beta"] != self.beta:
            raise ValueError(f"checkpoint beta {state['beta']} != configured beta {self.beta}")
        params: Mapping[str, Tensor] = state["params"]
        self._check_keys(params)
        self.weight = float(state["weight"])
        self.num_updates = int(state["num_updates"])
        self.num_resets = int(state["num_resets"])
        level = state.get("kept_level")  # absent in checkpoints older than the drop rule
        self.kept_level = None if level is None else float(level)
        self._dtypes = {name: getattr(torch, dtype) for name, dtype in state["dtypes"].items()}
        self._params = {
            name: p.detach().to(self._params[name].device).clone() for name, p in params.items()
        }
