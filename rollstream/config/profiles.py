"""Profiles: the settings that make a run learn, the same wherever a role starts.

A run's roles must agree on the model, its dtypes, the learning rate, the loss, the batch
and the producers' admission credit; a role started by hand from a config file gets them
from the same place as one started by ``rollstream up``. ``[profile]`` names the settings
(``ProfileConfig``); ``profile_sections`` turns them into role sections, besides the
model, dtypes and staleness window, which are shared settings
(``rollstream.config.shared`` propagates and checks them); and
``rollstream.config.settings.load_config`` lays those *under* whatever the file, the
environment or ``--set`` give explicitly, for every command.

The two profiles (``tiny`` and ``language-model``), their values, why they were chosen
and how ``precision = "auto"`` decides: docs/configuration.md, "Profiles".

``auto`` (the default) picks ``tiny`` for a tiny model spec and ``language-model`` for any
other; ``none`` applies nothing but the shared settings it declares (every other setting
comes from the file or the defaults).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from core.config import StrictModel
from core.models import MODEL_SPEC_HELP, ModelSpecName, parse_model_spec

ProfileName = Literal["auto", "tiny", "language-model", "none"]
Precision = Literal["auto", "bf16", "fp32"]


class ProfileConfig(StrictModel):
    """``[profile]``: which settings every role derives, and the few knobs they follow."""

    name: ProfileName = Field(
        default="auto",
        description="tiny | language-model | none | auto (tiny for a tiny model spec, "
        "language-model for any other).",
    )
    model: ModelSpecName = Field(
        default="tiny",
        description=MODEL_SPEC_HELP + " Given unchanged to all three roles ([producers.engine] "
        "model, [streams.old_logits] model, [trainer.model] spec); a file setting one of "
        "them otherwise is refused.",
    )
    task: str | None = Field(
        default=None,
        description="Task name; empty: copy-first-digit-twice (tiny) or arithmetic (others).",
    )
    sync: bool = Field(
        default=False,
        description="Synchronous baseline: staleness window 0, generation waits for each "
        "update (same code as async, only the derived settings differ).",
    )
    staleness_window: int = Field(
        default=2,
        ge=0,
        description="Async: how many versions generation may run ahead of training: the "
        "producers' admission credit, the stream's and the trainer's max_staleness (one "
        "value for all three; a file setting one of them otherwise is refused).",
    )
    groups_per_step: int | None = Field(
        default=None,
        ge=1,
        description="GRPO groups per trainer step; empty: 16 (tiny) or 4 (others).",
    )

    precision: Precision = Field(
        default="auto",
        description="Dtype of engine, old logits and trainer: bf16 | fp32 | auto (fp32 for "
        "the tiny model; for others bf16 where this machine computes it natively: a CUDA GPU "
        "with bf16 or a CPU with AVX-512; fp32 elsewhere, where bf16 is tens of times "
        "slower). Pin it when roles run on different hardware.",
    )

    @property
    def resolved_name(self) -> ProfileName:
        """The profile in force: ``auto`` resolved from the model spec."""
        if self.name != "auto":
            return self.name
        tiny = parse_model_spec(self.model, check_path=False).is_tiny
        return "tiny" if tiny else "language-model"

    @property
    def resolved_precision(self) -> Literal["bf16", "fp32"]:
        """The precision in force: ``auto`` resolved from the model and this machine."""
        if self.precision != "auto":
            return self.precision
        if self.resolved_name == "tiny":
            return "fp32"
        from core.models import bf16_is_native

        return "bf16" if bf16_is_native() else "fp32"

    @property
    def window(self) -> int:
        """The staleness window in force (0 in sync mode)."""
        return 0 if self.sync else self.staleness_window


def profile_sections(profile: ProfileConfig) -> dict[str, Any]:
    """Role sections derived from ``profile`` (nothing for ``none``), besides the shared
    settings (model, dtypes, staleness window), which ``rollstream.config.shared``
    propagates into every role."""
    name = profile.resolved_name
    if name == "none":
        return {}
    tiny = name == "tiny"
    groups = profile.groups_per_step or (16 if tiny else 4)
    return {
        # fp32 AdamW changes nearly every element each step: a delta is as large as a base,
        # so the tiny profile lets deltas be any size and runs the delta path (exact,
        # dense); a language model keeps the default threshold (see docs/weights-format.md)
        "weights": {"poll_interval_s": 0.5, **({"max_delta_fraction": 1.0} if tiny else {})},
        "producers": {
            "engine": {"torch_threads": 1},
            "rollout": {
                "task": profile.task or ("copy-first-digit-twice" if tiny else "arithmetic"),
                "group_size": 8,
                # no groups_per_version: producers take the trainer's announced pace,
                # shared between however many of them run
                "max_inflight_groups": min(groups, 8),
            },
        },
        "streams": {"groups": {"timeout_s": 60.0}},
        "trainer": {
            "engine": {"lr": 3e-3 if tiny else 2e-5, "zero_stage": 0},
            "loss": {"type": "decoupled"},
            # sync: a step waits for all of its groups; async: never wait long for stragglers
            "batch": {"max_groups": groups, "max_wait_s": 120.0 if profile.sync else 5.0},
            # versions in the dtype a language model is served in, whatever the trainer's
            **({} if tiny else {"publish": {"dtype": "bfloat16"}}),
        },
    }
