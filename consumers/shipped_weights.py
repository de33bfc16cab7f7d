"""The trainer's forward and backward on the weights it ships.

Under ``[trainer.publish] dtype = "bfloat16"`` with fp32 training, a version is the bf16
copy of the fp32 master weights. A trainer that computed its log-probs with the master
weights would optimise a policy it never ships: updates smaller than a bf16 rounding step
pile up in the master while the copy stays put, and the gap between the two grows step
after step (``bench.shipped_precision``). So, as in mixed-precision training, each
micro-step's forward and backward run on the master rounded to bf16 (held in fp32, so
the compute stays fp32) and the optimiser updates the exact master: the gradient of the
shipped policy, applied to the master weights. The trainer's log-probs at staleness 0
are then the stream's ``logp_old``, and checkpoints keep the master.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from weights import format as fmt


@dataclass
class ShippedRounding:
    """Rounds a module's floating weights to ``dtype`` in place for a while."""

    tensors: list[torch.Tensor]  # the module's weights, tied ones once
    dtype: torch.dtype
    masters: list[torch.Tensor]  # where the exact weights wait meanwhile, one per tensor

    @classmethod
    def for_module(cls, module: torch.nn.Module, dtype: torch.dtype) -> ShippedRounding:
        """Every floating tensor of ``module``'s state dict (what a version ships)."""
        unique, _aliases = fmt.split_aliases(module.state_dict(keep_vars=True))
        tensors = [t for t in unique.values() if t.is_floating_point() and t.dtype != dtype]
        return cls(tensors, dtype, [torch.empty_like(t) for t in tensors])

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside: the weights as shipped (rounded to ``dtype``). After, even on an error:
        the exact master weights again, before the optimiser steps."""
        with torch.no_grad():
            for tensor, master in zip(self.tensors, self.masters, strict=True):
                master.copy_(tensor)
                tensor.copy_(tensor.to(self.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, master in zip(self.tensors, self.masters, strict=True):
                    tensor.copy_(master)
