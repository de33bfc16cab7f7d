"""Configuration of the engine (``[producers.engine]``) and of a worker's connection to one.

Pydantic only, no torch: ``rollstream serve`` validates it before loading a model. The
connection is a protocol, not a section: ``[producers.rollout]`` carries its fields, and
the engine side reads only these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field, SecretStr, field_validator

from core.config import StrictModel
from core.models import MODEL_SPEC_HELP, ModelSpecName
from producers.engine.request_checks import DEFAULT_MAX_REQUEST_TOKENS


class SamplingConfig(StrictModel):
    """Sampling parameters sent to the engine, named as SGLang's ``sampling_params``."""

    temperature: float = Field(
        default=1.0, ge=0.0, description="0 means greedy (SGLang: top_k=1 at temperature 1)."
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1 disables it."
    )
    top_k: int = Field(default=-1, ge=-1, description="-1 disables top-k; else at least 1.")
    min_p: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Minimum probability relative to the top token; 0 disables it.",
    )
    max_new_tokens: int | None = Field(
        default=None,
        ge=1,
        description="None: the task's own limit. A multi-turn or gateway turn keeps its "
        "own budget (room left, the client's max_tokens) when that is lower.",
    )
    stop_token_ids: list[int] | None = Field(
        default=None, description="None: the task's stop tokens (usually EOS)."
    )
    ignore_eos: bool = Field(
        default=False, description="Keep generating past EOS, up to max_new_tokens."
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_disabled_or_positive(cls, value: int) -> int:
        """0 would make the engine refuse every request at run time."""
        if value == 0:
            raise ValueError("top_k = 0 keeps no token: -1 (disabled) or at least 1")
        return value

    def to_sglang(
        self, max_new_tokens: int, stop_token_ids: list[int], stop: list[str] | None = None
    ) -> dict[str, Any]:
        """The ``sampling_params`` object of one ``/generate`` request; ``stop`` strings
        (an environment's end of a tool call) only when there are some."""
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_new_tokens or max_new_tokens,
            "stop_token_ids": list(
                self.stop_token_ids if self.stop_token_ids is not None else stop_token_ids
            ),
            "ignore_eos": self.ignore_eos,
        }
        if stop:
            params["stop"] = list(stop)
        return params


class EngineConfig(StrictModel):
    """The CPU inference engine behind ``rollstream serve`` (and the worker's in-process one)."""

    model: ModelSpecName = Field(
        default="tiny",
        description=MODEL_SPEC_HELP + " The same spec as [streams.old_logits] model and "
        "[trainer.model] spec; the engine reports its canonical form as model_path.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="The engine's compute dtype (the profile sets it)."
    )
    host: str = Field(
        default="127.0.0.1",
        description="Address rollstream serve binds; anything but loopback needs api_key.",
    )
    port: int = Field(default=30000, ge=0, le=65535, description="0 picks a free port.")
    api_key: SecretStr | None = Field(
        default=None,
        description="Shared secret of the engine's HTTP API (SGLang's --api-key): every "
        "endpoint but /health needs 'Authorization: Bearer <key>', and producers send it. "
        "Required to bind a non-loopback host; rollstream up makes one per run.",
    )
    weights_dir: Path | None = Field(
        default=None,
        description="/update_weights_from_disk loads only from below this directory "
        "(producers write their versions there); None: <state_dir>/producers.",
    )
    max_batch_size: int = Field(
        default=64, ge=1, le=65_536, description="Most sequences decoded together in one batch."
    )
    batch_wait_ms: float = Field(
        default=0.5,
        ge=0.0,
        description="Batch window: collect requests until none arrived for this long "
        "(later ones join the running batch at the next decode step)...",
    )
    max_batch_wait_ms: float = Field(
        default=5.0, ge=0.0, description="...but for no longer than this."
    )
    torch_threads: int | None = Field(default=None, ge=1, description="None: torch default.")
    seed: int | None = Field(default=None, description="Seed of the sampling RNG.")
    prefix_cache_tokens: int = Field(
        default=8192,
        ge=0,
        description="Tokens of finished sequences whose KV cache is kept for requests "
        "that extend them (multi-turn episodes prefill only their new tokens); 0 disables.",
    )
    max_pending_requests: int = Field(
        default=1024,
        ge=1,
        description="Requests the engine holds at once (queued or running); more are "
        "answered HTTP 503 with Retry-After instead of queueing without bound.",
    )
    busy_retry_after_s: float = Field(
        default=1.0,
        gt=0.0,
        description="Retry-After sent with that 503 (rounded up to whole seconds).",
    )
    max_request_tokens: int = Field(
        default=DEFAULT_MAX_REQUEST_TOKENS,
        ge=1,
        description="Token budget of one /generate request: the sum over its prompts of "
        "prompt tokens plus max_new_tokens (capped by the context). A request over it is "
        "answered HTTP 413 with the numbers, so one client cannot hold the engine's memory "
        "or time; a rollout group needs group_size x (prompt + max_new_tokens).",
    )


class EngineConnection(Protocol):
    """How a worker reaches an engine over HTTP: the fields of ``[producers.rollout]``
    the client side reads (``RolloutConfig`` is one)."""

    @property
    def engine_url(self) -> str | None: ...
    @property
    def engine_router(self) -> bool: ...
    @property
    def expected_model(self) -> str | None: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def retries(self) -> int: ...
    @property
    def retry_max_wait_s(self) -> float: ...
