"""The whole configuration (``RollstreamConfig``): the shared sections of ``core.config``
plus each role's own section and ``[up]``. Pydantic only, no torch, so every entry point
validates its configuration before importing anything heavy. Unknown keys are errors.

Sources, earlier ones winning (``load_config``): explicit overrides (``--set``, ``--state-dir``),
``ROLLSTREAM_*`` variables (``ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS=...``, nested with ``__``),
the widely used ``KAFKA_BOOTSTRAP_SERVERS`` and ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, the TOML file (``--config``), the defaults. S3 credentials come from
the standard AWS chain unless the store is the embedded one.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from consumers.config import TrainerConfig
from core.config import SharedConfig, StrictModel, settings_from_sources
from core.models import MODEL_SPEC_HELP, parse_model_spec
from producers.config import ProducersConfig
from streams.config import StreamsConfig


class UpConfig(StrictModel):
    """``rollstream up``: the whole pipeline on one machine. The role sections are derived
    from these keys, under whatever the role sections of the file set explicitly."""

    sync: bool = Field(
        default=False,
        description="Synchronous baseline: staleness window 0, generation waits for each "
        "update (same code as async, only the derived config differs).",
    )
    staleness_window: int = Field(
        default=2,
        ge=0,
        description="Async mode: how many versions generation may run ahead of training "
        "(producers' admission credit and the streams' staleness filter).",
    )
    model: str = Field(
        default="tiny",
        description=MODEL_SPEC_HELP + " Given unchanged to all three roles ([producers.engine] "
        "model, [streams.old_logits] model, [trainer.model] spec). A tiny spec runs the tiny "
        "profile (float32 everywhere); any other model the language-model profile (bf16).",
    )
    task: str | None = Field(
        default=None,
        description="Task name; empty: copy-first-digit-twice (tiny) or arithmetic (others).",
    )
    groups_per_step: int | None = Field(
        default=None,
        ge=1,
        description="GRPO groups per optimiser step; empty: 16 (tiny) or 4 (others).",
    )
    max_steps: int = Field(default=150, ge=1, description="Stop after this many trainer steps.")
    stop_timeout_s: float = Field(
        default=30.0, gt=0, description="SIGTERM grace per role before SIGKILL."
    )
    ready_timeout_s: float = Field(
        default=300.0, gt=0, description="Longest wait for a role to become ready."
    )
    restarts: int = Field(
        default=0, ge=0, description="Restart a role that exits unexpectedly this many times."
    )
    pin_cores: bool = Field(
        default=False,
        description="Pin roles to CPU cores (os.sched_setaffinity): trainer and streams on "
        "the last core, engine and producer on the others, as if on separate devices.",
    )

    @field_validator("model")
    @classmethod
    def _canonical_model(cls, value: str) -> str:
        return parse_model_spec(value, check_path=False).name


class RollstreamConfig(SharedConfig):
    """The whole configuration: one file for every role (the shared sections, then each
    role's own)."""

    producers: ProducersConfig = Field(
        default_factory=ProducersConfig, description="[producers]: engine and rollout worker."
    )
    streams: StreamsConfig = Field(
        default_factory=StreamsConfig, description="[streams]: the Faust stream processors."
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="[trainer]: the DeepSpeed trainer."
    )
    up: UpConfig = Field(
        default_factory=UpConfig, description="[up]: `rollstream up` (all roles on one machine)."
    )


def load_config(path: Path | None = None, **overrides: Any) -> RollstreamConfig:
    """The whole config from its sources (``core.config.settings_from_sources``): explicit
    ``overrides`` > ``ROLLSTREAM_*`` variables > ``KAFKA_BOOTSTRAP_SERVERS`` /
    ``AWS_ENDPOINT_URL[_S3]`` > the TOML file > defaults."""
    return settings_from_sources(RollstreamConfig, path, overrides)


def parse_assignments(assignments: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Nested overrides from ``a.b.c=value`` assignments (``--set``); the right-hand side
    is read as a TOML value, else as a string. ``ValueError`` names a malformed one."""
    data: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {assignment!r}")
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key}: {part} is not a table")
        node[leaf] = _toml_value(value.strip())
    return data


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
