"""LoRA adapters given to the engine by name: SGLang's dynamic LoRA API
(``/load_lora_adapter``, ``/unload_lora_adapter``, ``lora_path`` on ``/generate``).

The engine's model carries one adapter slot (PEFT's ``default``, injected from the run's
``[lora]`` table, as SGLang's ``--enable-lora`` reserves its slots). A named adapter is a
directory as PEFT saves one (``adapter_config.json``, ``adapter_model.safetensors``); it is
checked against the slot (rank, scaling, every tensor's name and shape) and its bytes
against the sha256 its caller sent before anything is copied.

SGLang keeps many adapters in memory and serves each request with the one it names. This
engine serves **one adapter at a time**: the last one loaded. A request must name it
(``lora_path``), a request naming another one is refused, and unloading the adapter it
serves makes it serve the base model again (the slot's B set to zero). The check is made
when the request is queued, against the adapter the engine will serve when the request
runs: loads and unloads are queued between batches like every weight change.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from core.models import adapter_from_saved, is_adapter_tensor
from producers.engine.requests import RequestError
from producers.engine.weights import read_weights

ADAPTER_CONFIG = "adapter_config.json"


class AdapterRefused(ValueError):
    """A named adapter that does not fit the engine's slot (or is not there)."""


class NamedAdapters:
    """The adapters loaded by name and the one the engine serves once every queued change
    has run. Guarded by the engine's lock; ``read`` runs anywhere (it touches no state)."""

    def __init__(self, shapes: Mapping[str, torch.Size], rank: int, scaling: float) -> None:
        self.shapes = dict(shapes)
        self.rank = rank
        self.scaling = scaling
        self.loaded: dict[str, str] = {}  # name -> the directory it was read from
        self.serving: str | None = None

    @classmethod
    def of(cls, model: Any) -> NamedAdapters | None:
        """The slot of a model ``core.models.add_lora`` injected; None without one."""
        shapes = {n: t.shape for n, t in model.state_dict().items() if is_adapter_tensor(n)}
        if not shapes:  # no adapter: PEFT is not even imported
            return None
        from peft.tuners.lora import LoraLayer

        layer = next(m for m in model.modules() if isinstance(m, LoraLayer))
        return cls(shapes, int(layer.r["default"]), float(layer.scaling["default"]))

    def read(self, directory: Path, sha256: str) -> dict[str, torch.Tensor]:
        """The adapter in ``directory`` under the model's names, once its config fits the
        slot and its safetensors bytes have ``sha256``; ``AdapterRefused`` otherwise."""
        try:
            config = json.loads((directory / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise AdapterRefused(f"no readable {ADAPTER_CONFIG} in {directory}: {exc}") from None
        if not isinstance(config, dict):
            raise AdapterRefused(f"{ADAPTER_CONFIG} in {directory} is not a JSON object")
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(rank, int) or not isinstance(alpha, int | float):
            raise AdapterRefused(f"{ADAPTER_CONFIG} needs an integer r and a lora_alpha")
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        if rank != self.rank or not math.isclose(scaling, self.scaling, rel_tol=1e-6):
            raise AdapterRefused(
                f"adapter of rank {rank}, scaling {scaling:g}: this engine's slot has rank "
                f"{self.rank}, scaling {self.scaling:g} (the run's [lora] table)"
            )
        try:
            tensors = adapter_from_saved(read_weights(directory, sha256))
        except (OSError, ValueError) as exc:
            raise AdapterRefused(str(exc)) from None
        missing = sorted(set(self.shapes) - set(tensors))
        extra = sorted(set(tensors) - set(self.shapes))
        if missing or extra:
            raise AdapterRefused(
                f"adapter tensors do not match the slot: missing {missing[:3]}, unknown {extra[:3]}"
            )
        for name, tensor in tensors.items():
            if tensor.shape != self.shapes[name]:
                raise AdapterRefused(
                    f"{name} has shape {tuple(tensor.shape)}, the slot {tuple(self.shapes[name])}"
                )
        return tensors

    def check_request(self, name: str | None) -> None:
        """Refuse a request that does not name the adapter it would run with."""
        if name is None:
            if self.serving is not None:
                raise RequestError(
                    f"this engine serves LoRA adapter {self.serving!r}: name it in "
                    "lora_path (unload it to serve the base model)"
                )
            return
        if name not in self.loaded:
            raise RequestError(f"LoRA adapter {name!r} is not loaded")
        if name != self.serving:
            raise RequestError(
                f"LoRA adapter {name!r} is loaded but this engine serves {self.serving!r}: "
                "it serves one adapter at a time, the last one loaded"
            )

    def zeros(self) -> dict[str, torch.Tensor]:
        """The slot's tensors with B at zero: the adapter changes nothing."""
        return {
            name: torch.zeros(shape) for name, shape in self.shapes.items() if ".lora_B." in name
        }


def check_no_adapter(name: str | None) -> None:
    """A request naming an adapter on an engine without a LoRA slot."""
    if name is not None:
        raise RequestError(
            f"lora_path {name!r}: this engine has no LoRA slot (start it with the run's "
            "[lora] table, as SGLang needs --enable-lora)"
        )
