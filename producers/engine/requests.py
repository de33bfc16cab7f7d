"""What one engine request is: SGLang's sampling parameters, checked; its result; the
errors a client gets back; and the rules that end a request.

Kept apart from the scheduler so that the HTTP server and the clients can parse and
check requests without the batching machinery, and so that what a request may ask for
is read in one place: every setting SGLang accepts that would change the sampled tokens
and that this engine does not implement is refused by name, never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from producers.engine import request_checks as checks

SAMPLING_EPS = 1e-6

_Control = TypeVar("_Control", bound="ControlBody")


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
MAX_STOP_STRINGS = 16


def _stop_strings(value: Any) -> Any:
    """SGLang's ``stop``: one string or a list of them (null or empty: none)."""
    if value is None or value == "":
        return ()
    return (value,) if isinstance(value, str) else value


def _no_text(value: Any) -> Any:
    if value is not None:
        raise checks.refused("prompts are not supported: send input_ids")
    return value


def _top_k(value: int) -> int:
    if value == 0:
        raise checks.refused("must be -1 or in [1, {high}], got 0", high=checks.MAX_TOP_K)
    return value


StopString = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_STOP_CHARS)]


class SamplingBody(BaseModel):
    """SGLang's ``sampling_params`` as this engine reads them, with SGLang's defaults and
    the limits of each. Three kinds of field: those it honours; those that only shape the
    detokenized text (accepted, ignored); and those it takes only at their neutral value,
    as anything else would change the sampled tokens. Any other field is refused by name,
    never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: checks.Number = Field(1.0, ge=0)
    top_p: checks.Number = Field(1.0, gt=0, le=1)
    top_k: Annotated[checks.Integer, AfterValidator(_top_k)] = Field(-1, ge=-1, le=checks.MAX_TOP_K)
    min_p: checks.Number = Field(0.0, ge=0, le=1)
    max_new_tokens: checks.Integer = Field(128, ge=0, le=checks.MAX_NEW_TOKENS)
    stop_token_ids: tuple[checks.TokenId, ...] | None = Field(
        None, max_length=checks.MAX_STOP_TOKEN_IDS
    )
    stop: Annotated[
        tuple[StopString, ...], BeforeValidator(_stop_strings), Field(max_length=MAX_STOP_STRINGS)
    ] = ()
    ignore_eos: checks.Flag = False
    # text only
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    no_stop_trim: Any = None
    # neutral only
    n: Annotated[Any, checks.only(1)] = None
    frequency_penalty: Annotated[Any, checks.only(0, 0.0)] = None
    presence_penalty: Annotated[Any, checks.only(0, 0.0)] = None
    repetition_penalty: Annotated[Any, checks.only(1, 1.0)] = None
    min_new_tokens: Annotated[Any, checks.only(0)] = None
    json_schema: Annotated[Any, checks.only(None)] = None
    regex: Annotated[Any, checks.only(None)] = None
    ebnf: Annotated[Any, checks.only(None)] = None
    structural_tag: Annotated[Any, checks.only(None)] = None
    logit_bias: Annotated[Any, checks.only(None)] = None
    custom_params: Annotated[Any, checks.only(None)] = None


#: Fields SGLang's router adds to every ``/generate`` it forwards, with the values it sends;
#: accepted at those values only (each asks for something this engine does not do).
ROUTER_DEFAULTS: dict[str, Any] = {
    "model": None,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


def _per_item(kind: type) -> WrapValidator:
    """SGLang's per-input field: one value for every input, or a list of one per input
    (their count is checked against the inputs' by ``GenerateBody``)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise checks.refused("must be a {kind} or a list of them", kind=kind.__name__) from None

    return WrapValidator(check)


def _prompts(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if not isinstance(value, list) or not value:
        raise checks.refused("must be a non-empty list of token ids or of lists")
    try:
        return handler(value)
    except ValidationError:
        raise checks.refused("must hold integers (one list per prompt)") from None


def _no_input_logprobs(value: Any) -> Any:
    if value is None or value == -1 or (isinstance(value, list) and all(v == -1 for v in value)):
        return value
    raise checks.refused("asks for input-token log-probs (logprob_start_len >= 0): not supported")


def _falsy(why: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if value:
            raise checks.refused(why)
        return value

    return AfterValidator(check)


_TokenIds = list[Annotated[int, Strict()]]


class GenerateBody(BaseModel):
    """SGLang's ``/generate`` body as this engine reads it: token prompts only (one, or a
    batch of lists), per-input fields as one value or a list of one per input; every
    other field SGLang takes that asks for something this engine does not do is refused
    by name. ``sampling_params`` are read per input by ``SamplingBody``."""

    model_config = ConfigDict(extra="forbid")

    text: Annotated[Any, AfterValidator(_no_text)] = None
    input_ids: Annotated[_TokenIds | list[_TokenIds], WrapValidator(_prompts)] = Field(
        None, validate_default=True
    )
    rid: Annotated[str | list[str | None] | None, _per_item(str)] = None
    sampling_params: Annotated[
        dict[str, Any] | list[dict[str, Any] | None] | None, _per_item(dict)
    ] = None
    return_logprob: Annotated[checks.Flag | list[checks.Flag | None] | None, _per_item(bool)] = None
    lora_path: Annotated[str | list[str | None] | None, _per_item(str)] = None
    stream: checks.Flag = False
    logprob_start_len: Annotated[Any, AfterValidator(_no_input_logprobs)] = None
    top_logprobs_num: Annotated[Any, _falsy("is not supported")] = None
    token_ids_logprob: Annotated[Any, _falsy("is not supported")] = None
    return_text_in_logprobs: Any = None
    log_metrics: Any = None
    model: Annotated[Any, checks.only(None, absent=False)] = None
    return_hidden_states: Annotated[Any, checks.only(False, absent=False)] = False
    background: Annotated[Any, checks.only(False, absent=False)] = False
    no_logs: Annotated[Any, checks.only(False, absent=False)] = False
    return_bytes: Annotated[Any, checks.only(False, absent=False)] = False
    return_entropy: Annotated[Any, checks.only(False, absent=False)] = False

    @property
    def batch(self) -> bool:
        return isinstance(self.input_ids[0], list)

    @model_validator(mode="after")
    def _one_per_input(self) -> GenerateBody:
        if self.stream and self.batch:
            raise checks.refused("stream=true takes one prompt (input_ids a list of token ids)")
        n = len(self.input_ids) if self.batch else 1
        for name in ("rid", "sampling_params", "return_logprob", "lora_path"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != n:
                raise checks.refused(
                    "{name} has {got} entries for {n} inputs", name=name, got=len(value), n=n
                )
        return self

    def per_input(self, name: str) -> list[Any]:
        """Field ``name``'s value for each input (a batch's one ``rid`` is SGLang's prefix:
        ``rid-0``, ``rid-1``, ...)."""
        value = getattr(self, name)
        n = len(self.input_ids) if self.batch else 1
        if isinstance(value, list):
            return value
        if name == "rid" and value is not None and n > 1:
            return [f"{value}-{i}" for i in range(n)]
        return [value] * n


MAX_NAME_CHARS = 256
"""Of a ``rid`` to abort, an adapter's name, a weight version (every answer repeats it)."""
MAX_PATH_CHARS = 4096
"""Linux's ``PATH_MAX``: of a weights or adapter directory."""

Name = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_NAME_CHARS)]
WeightsPath = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_PATH_CHARS)]


def _sha256(of: str) -> Any:
    """Ours, not SGLang's: the sha256 (64 hex digits) of the safetensors bytes the engine
    is to load; it loads nothing else."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if value is None:
            raise checks.refused("is required: the sha256 of {of}", of=of)
        try:
            return handler(value)
        except ValidationError:
            raise checks.refused("must be 64 hex digits: the sha256 of {of}", of=of) from None

    return Annotated[
        str, Strict(), Field(pattern=r"^[0-9a-fA-F]{64}$"), WrapValidator(check)
    ]  # fmt: skip


class ControlBody(BaseModel):
    """A body of SGLang's control endpoints. SGLang's request structs ignore fields they do
    not know, and its clients send fields that matter only to a GPU server
    (``flush_cache``, ``is_async``, ``lora_id``, ...): ignored here too."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class AbortBody(ControlBody):
    """``/abort_request``: one request by ``rid`` (``""``: none), or every one."""

    rid: Annotated[str, Strict(), Field(max_length=MAX_NAME_CHARS)] | None = None
    abort_all: checks.Flag = False


class UpdateWeightsBody(ControlBody):
    """``/update_weights_from_disk``: a checkpoint directory below the weights directory
    and the sha256 of its bytes; ``weight_version`` is what answers are tagged with."""

    model_path: WeightsPath
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: checks.Flag = False
    weight_version: Name | None = None
    weights_sha256: _sha256("the safetensors file to load") = Field(None, validate_default=True)


class LoadLoraBody(ControlBody):
    """``/load_lora_adapter``: a PEFT adapter directory served as ``lora_name``."""

    lora_name: Name
    lora_path: WeightsPath
    pinned: checks.Flag = False
    weights_sha256: _sha256("the adapter's safetensors file") = Field(None, validate_default=True)


class UnloadLoraBody(ControlBody):
    """``/unload_lora_adapter``: the adapter named ``lora_name`` forgotten."""

    lora_name: Name


def control_body(model: type[_Control], body: dict[str, Any]) -> _Control:
    """``body`` as a control endpoint's ``model``, or ``RequestError`` naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestError(checks.refusal(exc)) from exc


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
        """Parse an SGLang ``sampling_params`` object, or ``RequestError`` naming the
        field and its problem."""
        try:
            body = SamplingBody.model_validate(values or {})
        except ValidationError as exc:
            raise RequestError(checks.refusal(exc, "sampling_params")) from exc
        return cls(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            max_new_tokens=body.max_new_tokens,
            stop_token_ids=body.stop_token_ids or (),
            stop=body.stop,
            ignore_eos=body.ignore_eos,
        )

    def check(self) -> None:
        """The same limits for parameters built in Python: a value that reached a batch
        would fail every request sharing it."""
        self.from_dict({f: getattr(self, f) for f in self.__slots__})

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
