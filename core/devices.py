"""Compute device names: one spelling for every role that places tensors.

A config names a device as ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. The names are
checked without torch (configs validate instantly) and resolved to a ``torch.device``
once, where the role starts: ``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_NAMES = "auto, cpu, cuda or cuda:N"
"""What ``check_device_name`` accepts, for messages and field descriptions."""

_DEVICE = re.compile(r"auto|cpu|cuda(?::(?:0|[1-9][0-9]*))?")


def check_device_name(name: str) -> str:
    """``name`` when it is one of ``DEVICE_NAMES``; else ``ValueError`` saying so."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(f"device must be {DEVICE_NAMES} (N a GPU index), not {name!r}")
    return name


def resolve_device(name: str = "auto") -> torch.device:
    """The ``torch.device`` that ``name`` means on this machine.

    A CUDA device asked for by name on a machine without one is refused here, at start,
    rather than at the first tensor that moves."""
    import torch

    check_device_name(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch sees no CUDA device on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device
