"""Command lines for SGLang's own server and router, and the check that they are installed.

``rollstream serve --engine sglang`` and ``rollstream router`` run these (the process
becomes SGLang's, so a supervisor's signals reach it directly). Both keep the project's
rule: loopback unless configured, and an API key for anything else. The flags are pinned
to SGLang's own definitions by ``tests/unit/producers/test_sglang_contract.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

#: The SGLang release whose HTTP API and server flags the project follows.
SGLANG_VERSION = "0.5.23"
#: The router release tested in front of our engines.
SGLANG_ROUTER_VERSION = "0.3.2"


class NotInstalled(RuntimeError):
    """SGLang (or its router) is missing from this Python environment."""


def require_module(module: str, install: str) -> None:
    """Raise ``NotInstalled`` saying how to install ``module`` when it cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise NotInstalled(
            f"{module} is not installed in {sys.prefix}: install it with `{install}`"
        )


@dataclass(frozen=True)
class SGLangServer:
    """``python -m sglang.launch_server`` serving ``model`` for a run; with ``lora_rank``
    (a LoRA run) it reserves adapter slots of that rank on ``lora_target_modules``, so
    versions arrive through ``/load_lora_adapter``."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    weight_version: str | None = None
    extra_args: tuple[str, ...] = ()
    lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()

    module: ClassVar[str] = "sglang"
    install: ClassVar[str] = (
        f'pip install "sglang[all]=={SGLANG_VERSION}"  (a GPU machine with CUDA)'
    )

    def argv(self, python: str = sys.executable) -> list[str]:
        argv = [python, "-m", "sglang.launch_server", "--model-path", self.model]
        argv += ["--host", self.host, "--port", str(self.port)]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        if self.weight_version is not None:
            argv += ["--weight-version", self.weight_version]
        if self.lora_rank is not None:
            argv += ["--enable-lora", "--max-lora-rank", str(self.lora_rank)]
            argv += ["--lora-target-modules", *self.lora_target_modules]
        return argv + list(self.extra_args)


@dataclass(frozen=True)
class SGLangRouter:
    """``python -m sglang_router.launch_router`` in front of ``engine_urls``: round robin
    (every engine serves the same policy version, so any one will do), its Prometheus
    endpoint on loopback (the router's default is every interface)."""

    engine_urls: Sequence[str]
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    metrics_port: int = 29000
    metrics_host: str = "127.0.0.1"

    module: ClassVar[str] = "sglang_router"
    install: ClassVar[str] = f'pip install "sglang-router=={SGLANG_ROUTER_VERSION}"'

    def argv(self, python: str = sys.executable) -> list[str]:
        if not self.engine_urls:
            raise ValueError("the router needs at least one engine URL")
        if bad := [u for u in self.engine_urls if not u.startswith(("http://", "https://"))]:
            raise ValueError(f"engine URLs must start with http:// or https://: {bad}")
        argv = [python, "-m", "sglang_router.launch_router", "--host", self.host]
        argv += ["--port", str(self.port), "--worker-urls", *self.engine_urls]
        argv += ["--policy", "round_robin", "--log-level", "warn"]
        argv += [
            "--prometheus-host",
            self.metrics_host,
            "--prometheus-port",
            str(self.metrics_port),
        ]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        return argv
