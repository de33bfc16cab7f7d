"""LoRA states for tests: what a trained adapter on the tiny model looks like."""

from __future__ import annotations

import torch

from core.config import LoraConfig
from core.models import is_adapter_tensor, load_model

LORA = LoraConfig(rank=4, alpha=8.0)


def trained(version: int, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state of a tiny LoRA model (``LORA``) whose adapter some training moved (B is
    0 at version 0, so version 0 is the base model's behaviour); with ``base``, on that
    state's base tensor objects, as a follower's snapshots share them."""
    model = load_model("tiny", lora=LORA)
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad and version:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    state = model.state_dict()
    if base is not None:
        state.update({n: t for n, t in base.items() if not is_adapter_tensor(n)})
    return state
