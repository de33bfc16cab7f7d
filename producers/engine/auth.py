"""Who may drive the engine's HTTP API, and which weights it may load.

Anyone who reaches the API can abort every request and hot-swap the weights every
producer samples from, so the server follows SGLang's ``--api-key``: with a key, every
endpoint but ``/health`` (a liveness probe that tells nothing) needs
``Authorization: Bearer <key>``. Without a key the engine only binds loopback.
``/update_weights_from_disk`` loads only from below the engine's weights directory (the
producers write their versions there), so a caller cannot point it at any file the
engine's user can read.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

OPEN_PATHS = frozenset({"/health"})
"""Endpoints answered without the key."""


class AccessRefused(Exception):
    """A request the engine refuses (``status``: 401 or 403)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); a name that must be
    resolved counts as non-loopback: what it resolves to may change."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ENGINE_EXPOSURE = (
    "the engine",
    "could swap its weights; set [producers.engine] api_key (or `rollstream serve --api-key`)",
)


def check_bind(host: str, api_key: str | None, exposure: tuple[str, str] = ENGINE_EXPOSURE) -> None:
    """Refuse to serve on a non-loopback ``host`` without an API key. ``exposure``: what is
    served and what anyone reaching it could do, with the setting that gives it a key."""
    if not api_key and not is_loopback(host):
        what, risk = exposure
        raise ValueError(
            f"refusing to serve {what} on {host!r} without an API key: anyone who reaches "
            f"it {risk} or bind 127.0.0.1"
        )


def check_key(
    path: str,
    authorization: str | None,
    api_key: str | None,
    setting: str = "[producers.engine] api_key",
) -> None:
    """Raise ``AccessRefused`` (401) unless ``authorization`` is ``Bearer <api_key>``
    (compared in constant time), the server has no key, or ``path`` is open. ``setting``:
    where the caller finds the key, named in the refusal."""
    if not api_key or path in OPEN_PATHS:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), api_key.encode()
    ):
        what = "no" if not authorization else "a wrong"
        raise AccessRefused(
            f"{path}: {what} api key (send Authorization: Bearer <{setting}>)",
            401,
        )


def weights_path(model_path: str, weights_dir: Path | None) -> Path:
    """``model_path`` resolved (links and ``..`` followed), if it lies below
    ``weights_dir``; else ``AccessRefused`` (403) naming both."""
    if weights_dir is None:
        raise AccessRefused(
            f"refusing to load weights from {model_path!r}: this engine has no weights "
            "directory ([producers.engine] weights_dir)",
            403,
        )
    root = Path(os.path.realpath(weights_dir))
    target = Path(os.path.realpath(model_path))
    if not target.is_relative_to(root):
        raise AccessRefused(
            f"refusing to load weights from {model_path!r}: outside the weights directory "
            f"{str(root)!r}",
            403,
        )
    return target
