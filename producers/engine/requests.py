"""What one engine request is: SGLang's sampling parameters, checked; its result; the
errors a client gets back; and the rules that end a request.

Kept apart from the scheduler so that the HTTP server and the clients can parse and
check requests without the batching machinery, and so that what a request may ask for
is read in one place: every setting SGLang accepts that would change the sampled tokens
and that this engine does not implement is refused by name, never silently ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from producers.engine import request_checks as checks

SAMPLING_EPS = 1e-6

# Sampling parameters this engine honours, with SGLang's defaults.
_SUPPORTED = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "max_new_tokens": 128,
    "stop_token_ids": None,
    "stop": None,
    "ignore_eos": False,
}
# Accepted and ignored: they only shape the detokenized text, never the tokens.
_TEXT_ONLY = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})
# Accepted only at their neutral value: anything else would change the sampled tokens.
_NEUTRAL = {
    "n": (1,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None,),
    "custom_params": (None,),
}


class RequestError(ValueError):
    """A request the engine cannot serve (answered with HTTP 400)."""


class EngineBusy(RuntimeError):
    """The engine holds ``max_pending`` requests already: try again after
    ``retry_after_s`` (answered with HTTP 503 and ``Retry-After``)."""

    def __init__(self, pending: int, limit: int, retry_after_s: float) -> None:
        super().__init__(
            f"engine busy: {pending} request(s) queued or running, limit {limit}; "
            f"retry after {retry_after_s:g}s"
        )
        self.retry_after_s = retry_after_s


MAX_STOP_CHARS = 64


def _stop_strings(value: Any) -> tuple[str, ...]:
    """SGLang's ``stop``: one string or a list of them (empty: none)."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise TypeError(f"sampling_params.stop must be a string or a list of strings, got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The subset of SGLang's ``sampling_params`` that this engine implements."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the output text has one
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SamplingParams:
        """Parse an SGLang ``sampling_params`` object; unsupported settings raise
        ``RequestError`` naming them instead of being silently ignored."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(_SUPPORTED) - _TEXT_ONLY - set(_NEUTRAL))
        if unknown:
            raise RequestError(f"unsupported sampling_params: {unknown}")
        for key, neutral in _NEUTRAL.items():
            value = values.get(key)
            if value is not None and value not in neutral and value != []:
                raise RequestError(
                    f"sampling_params.{key}={value!r} is not supported by this engine "
                    f"(only {neutral[0]!r})"
                )
        try:
            params = cls(
                temperature=checks.number(values, "temperature", 1.0),
                top_p=checks.number(values, "top_p", 1.0),
                top_k=checks.integer(values, "top_k", -1, -1, checks.MAX_TOP_K),
                min_p=checks.number(values, "min_p", 0.0),
                max_new_tokens=checks.integer(
                    values, "max_new_tokens", 128, 0, checks.MAX_NEW_TOKENS
                ),
                stop_token_ids=checks.token_ids(values, "stop_token_ids"),
                stop=_stop_strings(values.get("stop")),
                ignore_eos=checks.flag(values, "ignore_eos", False),
            )
        except TypeError as exc:
            raise RequestError(f"bad sampling_params: {exc}") from exc
        except checks.RequestRefused as exc:
            raise RequestError(str(exc)) from exc
        params.check()
        return params

    def check(self) -> None:
        """Ranges, in the form NaN fails too (``not 0 <= nan``): a value that reached a
        batch would fail every request sharing it."""
        if not 0 <= self.temperature < math.inf:
            raise RequestError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or not -1 <= self.top_k <= checks.MAX_TOP_K:
            raise RequestError(
                f"sampling_params.top_k must be -1 or in [1, {checks.MAX_TOP_K}], got {self.top_k}"
            )
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"sampling_params.min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise RequestError(
                f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}"
            )
        if any(not s or len(s) > MAX_STOP_CHARS for s in self.stop) or len(self.stop) > 16:
            raise RequestError(
                f"sampling_params.stop must be at most 16 strings of 1 to {MAX_STOP_CHARS} "
                "characters"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


@dataclass
class GenerateResult:
    """One finished request: SGLang's response object is ``to_sglang()``."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: dict[str, Any]
    weight_version: str
    e2e_latency: float
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def to_sglang(self, text: str = "") -> dict[str, Any]:
        """The JSON object SGLang's ``/generate`` returns for one input."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "e2e_latency": self.e2e_latency,
        }
        if self.output_logprobs is not None:
            meta["output_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(self.output_logprobs, self.output_ids, strict=True)
            ]
        return {"text": text, "output_ids": self.output_ids, "meta_info": meta}


TokenListener = Callable[[int, float], None]
"""Told, in the scheduler thread, of each token a request draws and its log-prob."""


@dataclass(eq=False)
class Request:
    """One request while the engine holds it: queued, then running."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    future: Future = field(default_factory=Future)
    created: float = field(default_factory=time.perf_counter)
    aborted: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    on_token: TokenListener | None = None  # told of each token as it is drawn (a stream)


def new_request(
    input_ids: Sequence[int],
    params: SamplingParams,
    rid: str | None,
    logprob: bool,
    *,
    vocab_size: int,
    context_length: int,
    tokenizer: Any,
) -> Request:
    """A ``Request`` for a model with this vocabulary and context; ``RequestError`` if
    the model cannot serve it."""
    ids = [int(t) for t in input_ids]
    if not ids:
        raise RequestError("input_ids is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= context_length:
        raise RequestError(
            f"prompt of {len(ids)} tokens leaves no room in the context of {context_length} tokens"
        )
    params.check()
    if params.stop and tokenizer is None:
        raise RequestError("stop strings need the engine's tokenizer; this engine has none")
    return Request(rid or uuid.uuid4().hex, ids, params, bool(logprob))


def stop_reason(
    request: Request,
    token: int,
    *,
    eos_token_ids: Sequence[int],
    context_length: int,
    tokenizer: Any,
) -> dict[str, Any] | None:
    """Why ``request`` ends with ``token`` just drawn (SGLang's ``finish_reason``), or
    ``None`` while it goes on."""
    params = request.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return {"type": "stop", "matched": token}
    if params.stop:
        # a stop string spans at most its length in tokens, plus one partly decoded
        window = max(len(s) for s in params.stop) + 1
        tail = tokenizer.decode(request.output_ids[-window:])
        for stop in params.stop:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    if len(request.output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if len(request.input_ids) + len(request.output_ids) >= context_length:
        return {"type": "length", "length": len(request.output_ids)}
    return None
