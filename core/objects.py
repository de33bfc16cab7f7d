"""Loading user objects named by a dotted path (tasks, stream operators)."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(path: str) -> Any:
    """The object at ``package.module:attr`` (or ``package.module.attr``)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module:function'")
    module = importlib.import_module(module_name)
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise ValueError(f"{module_name} has no attribute {attr!r}") from exc
    return obj
