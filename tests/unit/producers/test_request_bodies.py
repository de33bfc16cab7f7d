"""The HTTP bodies the engine and the gateway take, as their pydantic models read them:
garbage of every kind (a wrong type, a value out of range, an unknown field, a list too
long) is refused naming the field, and what a client may send comes through unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from producers.engine.requests import (
    MAX_NAME_CHARS,
    AbortBody,
    ControlBody,
    LoadLoraBody,
    RequestError,
    SamplingParams,
    UnloadLoraBody,
    UpdateWeightsBody,
    control_body,
)
from producers.engine.server import parse_generate
from producers.gateway.requests import BadRequest, chat_request, completion_request

pytestmark = pytest.mark.unit

PROMPT = [1, 5, 6]
LIMIT = 64

GENERATE_GARBAGE: list[tuple[dict[str, Any], str]] = [
    ({}, "input_ids must be a non-empty list"),
    ({"input_ids": []}, "input_ids must be a non-empty list"),
    ({"input_ids": "1 5 6"}, "input_ids must be a non-empty list"),
    ({"input_ids": [1, "5"]}, "input_ids must hold integers"),
    ({"input_ids": [True, 5]}, "input_ids must hold integers"),
    ({"input_ids": [1.0, 5]}, "input_ids must hold integers"),
    ({"input_ids": [PROMPT, 3]}, "input_ids must hold integers"),
    ({"input_ids": PROMPT, "rid": 7}, "rid must be a str or a list of them"),
    ({"input_ids": PROMPT, "rid": [7]}, "rid must be a str or a list of them"),
    ({"input_ids": [PROMPT, PROMPT], "rid": ["a", "a"]}, "rid values must be unique"),
    ({"input_ids": [PROMPT, PROMPT], "sampling_params": [{}]}, "sampling_params has 1 entries"),
    ({"input_ids": PROMPT, "sampling_params": "greedy"}, "sampling_params must be a dict"),
    ({"input_ids": PROMPT, "sampling_params": {"top_k": "5"}}, "sampling_params.top_k"),
    ({"input_ids": PROMPT, "return_logprob": 1}, "return_logprob must be a bool"),
    ({"input_ids": PROMPT, "return_logprob": "true"}, "return_logprob must be a bool"),
    ({"input_ids": PROMPT, "stream": None}, "stream must be true or false"),
    ({"input_ids": PROMPT, "top_logprobs_num": 5}, "top_logprobs_num is not supported"),
    ({"input_ids": PROMPT, "token_ids_logprob": [3]}, "token_ids_logprob is not supported"),
    ({"input_ids": PROMPT, "logprob_start_len": [0]}, "input-token"),
    ({"input_ids": PROMPT, "background": True}, "background=True is not supported"),
    ({"input_ids": PROMPT, "no_logs": None}, "no_logs=None is not supported"),
    ({"input_ids": PROMPT, "input_embeds": [[0.1]]}, "input_embeds is not supported"),
]


@pytest.mark.parametrize(("body", "why"), GENERATE_GARBAGE, ids=[w for _, w in GENERATE_GARBAGE])
def test_generate_garbage_is_refused_naming_the_field(body: dict[str, Any], why: str) -> None:
    with pytest.raises(RequestError, match=why.replace("[", r"\[")):
        parse_generate(body)


def test_generate_bodies_a_client_sends_come_through() -> None:
    batch = parse_generate(
        {
            "input_ids": [PROMPT, [2, 3]],
            "rid": "r",
            "sampling_params": [{"max_new_tokens": 3}, None],
            "return_logprob": [True, None],
            "logprob_start_len": -1,
            "lora_path": ["a", "a"],
            "model": None,
            "return_hidden_states": False,
            "return_text_in_logprobs": True,
        }
    )
    assert batch.batch and batch.adapter == "a" and not batch.stream
    assert [(i.input_ids, i.rid, i.return_logprob) for i in batch.items] == [
        (PROMPT, "r-0", True),
        ([2, 3], "r-1", False),
    ]
    assert [i.params.max_new_tokens for i in batch.items] == [3, 128]
    one = parse_generate({"input_ids": PROMPT, "stream": True, "top_logprobs_num": 0})
    assert not one.batch and one.stream and one.items[0].rid is None


SAMPLING_GARBAGE: list[tuple[dict[str, Any], str]] = [
    ({"stop": ["a"] * 17}, "sampling_params.stop"),
    ({"stop": "x" * 65}, r"sampling_params.stop\[0\]"),
    ({"stop_token_ids": list(range(257))}, "sampling_params.stop_token_ids"),
    ({"stop_token_ids": [1, True]}, r"sampling_params.stop_token_ids\[1\]"),
    ({"top_k": 2**31}, "sampling_params.top_k"),
    ({"min_p": 1.5}, "sampling_params.min_p"),
    ({"top_p": 1.01}, "sampling_params.top_p"),
    ({"min_new_tokens": 4}, "sampling_params.min_new_tokens=4 is not supported"),
    ({"logit_bias": {"3": 1.0}}, "sampling_params.logit_bias"),
    ({"max_tokens": 8}, "sampling_params.max_tokens is not supported"),
]


@pytest.mark.parametrize(("values", "why"), SAMPLING_GARBAGE, ids=[w for _, w in SAMPLING_GARBAGE])
def test_sampling_garbage_is_refused_naming_the_field(values: dict[str, Any], why: str) -> None:
    with pytest.raises(RequestError, match=why):
        SamplingParams.from_dict(values)


def test_sampling_params_built_in_python_meet_the_same_limits() -> None:
    SamplingParams(temperature=0.0, top_k=1, stop=("\n",), stop_token_ids=(2,)).check()
    for params, why in [
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_k=0), "top_k must be -1 or in"),
        (SamplingParams(stop=("",)), "stop"),
    ]:
        with pytest.raises(RequestError, match=why):
            params.check()
    whole = SamplingParams.from_dict({"top_k": 5.0, "max_new_tokens": 7.0, "temperature": 1})
    assert (whole.top_k, whole.max_new_tokens, whole.temperature) == (5, 7, 1.0)
    assert isinstance(whole.top_k, int) and isinstance(whole.temperature, float)


SHA = "ab" * 32
WEIGHTS = {"model_path": "/weights/v1", "weights_sha256": SHA}
ADAPTER = {"lora_name": "v1", "lora_path": "/weights/v1", "weights_sha256": SHA}
CONTROL_GARBAGE: list[tuple[type[ControlBody], dict[str, Any], str]] = [
    (AbortBody, {"rid": 7}, "rid: input should be a valid string"),
    (AbortBody, {"rid": ["a"]}, "rid: input should be a valid string"),
    (AbortBody, {"rid": "r" * (MAX_NAME_CHARS + 1)}, "rid: string should have at most"),
    (AbortBody, {"abort_all": 1}, "abort_all must be true or false, got 1"),
    (AbortBody, {"abort_all": "true"}, "abort_all must be true or false"),
    (AbortBody, {"abort_all": None}, "abort_all must be true or false"),
    (UpdateWeightsBody, {}, "model_path is required"),
    (UpdateWeightsBody, {**WEIGHTS, "model_path": ""}, "model_path: string should have at least"),
    (UpdateWeightsBody, {**WEIGHTS, "model_path": 5}, "model_path: input should be a valid string"),
    (UpdateWeightsBody, {**WEIGHTS, "model_path": "/" * 5000}, "model_path: string should have"),
    (UpdateWeightsBody, {**WEIGHTS, "load_format": "pt"}, "load_format: input should be 'auto'"),
    (UpdateWeightsBody, {**WEIGHTS, "load_format": 1}, "load_format"),
    (UpdateWeightsBody, {**WEIGHTS, "abort_all_requests": 1}, "abort_all_requests must be true"),
    (UpdateWeightsBody, {**WEIGHTS, "weight_version": 3}, "weight_version: input should be"),
    (UpdateWeightsBody, {**WEIGHTS, "weight_version": True}, "weight_version: input should be"),
    (UpdateWeightsBody, {**WEIGHTS, "weight_version": "9" * 300}, "weight_version: string"),
    (UpdateWeightsBody, {"model_path": "/w"}, "weights_sha256 is required: the sha256 of"),
    (UpdateWeightsBody, {**WEIGHTS, "weights_sha256": None}, "weights_sha256 is required"),
    (UpdateWeightsBody, {**WEIGHTS, "weights_sha256": ""}, "weights_sha256 must be 64 hex"),
    (UpdateWeightsBody, {**WEIGHTS, "weights_sha256": "g" * 64}, "weights_sha256 must be 64 hex"),
    (UpdateWeightsBody, {**WEIGHTS, "weights_sha256": SHA + "0"}, "weights_sha256 must be 64"),
    (UpdateWeightsBody, {**WEIGHTS, "weights_sha256": 0}, "weights_sha256 must be 64 hex"),
    (LoadLoraBody, {k: v for k, v in ADAPTER.items() if k != "lora_name"}, "lora_name is required"),
    (LoadLoraBody, {k: v for k, v in ADAPTER.items() if k != "lora_path"}, "lora_path is required"),
    (LoadLoraBody, {**ADAPTER, "lora_name": 5}, "lora_name: input should be a valid string"),
    (LoadLoraBody, {**ADAPTER, "lora_name": ""}, "lora_name: string should have at least"),
    (LoadLoraBody, {**ADAPTER, "lora_name": "n" * 257}, "lora_name: string should have at most"),
    (LoadLoraBody, {**ADAPTER, "lora_path": ["x"]}, "lora_path: input should be a valid string"),
    (LoadLoraBody, {**ADAPTER, "pinned": "yes"}, "pinned must be true or false"),
    (LoadLoraBody, {**ADAPTER, "weights_sha256": False}, "weights_sha256 must be 64 hex"),
    (LoadLoraBody, {"lora_name": "a", "lora_path": "/w"}, "the adapter's safetensors file"),
    (UnloadLoraBody, {}, "lora_name is required"),
    (UnloadLoraBody, {"lora_name": None}, "lora_name: input should be a valid string"),
    (UnloadLoraBody, {"lora_name": {"a": 1}}, "lora_name: input should be a valid string"),
]


@pytest.mark.parametrize(
    ("model", "body", "why"),
    CONTROL_GARBAGE,
    ids=[f"{m.__name__}-{w}"[:60] for m, _, w in CONTROL_GARBAGE],
)
def test_control_garbage_is_refused_naming_the_field(
    model: type[ControlBody], body: dict[str, Any], why: str
) -> None:
    with pytest.raises(RequestError, match=why):
        control_body(model, body)


def test_control_bodies_sglangs_clients_send_come_through() -> None:
    """SGLang's fields this engine has no use for (``flush_cache``, ``lora_id``, ...) are
    ignored, as SGLang ignores fields it does not know."""
    abort = control_body(AbortBody, {"rid": "", "abort_all": True, "abort_message": "x"})
    assert (abort.rid, abort.abort_all) == ("", True)
    assert control_body(AbortBody, {}) == AbortBody(rid=None, abort_all=False)
    update = control_body(
        UpdateWeightsBody,
        {**WEIGHTS, "weight_version": "3", "abort_all_requests": True, "flush_cache": True,
         "is_async": False, "load_format": "auto", "weights_sha256": SHA.upper()},
    )  # fmt: skip
    assert (update.model_path, update.weight_version, update.abort_all_requests) == (
        "/weights/v1",
        "3",
        True,
    )
    assert update.weights_sha256 == SHA.upper()  # compared case-blind with the file's
    load = control_body(LoadLoraBody, {**ADAPTER, "pinned": True, "lora_id": None})
    assert (load.lora_name, load.lora_path, load.pinned) == ("v1", "/weights/v1", True)
    assert control_body(UnloadLoraBody, {"lora_name": "v1", "lora_id": "x"}).lora_name == "v1"


CHAT = {"messages": [{"role": "user", "content": "2+3?"}]}
CHAT_GARBAGE: list[tuple[dict[str, Any], str]] = [
    ({"messages": None}, "'messages' must be a list of 1 to"),
    ({"messages": [CHAT["messages"][0]] * 4097}, "'messages' must be a list of 1 to"),
    ({"messages": [{"role": "robot"}]}, r"messages\[0\].role' must be one of"),
    ({"messages": [{"content": "hi"}]}, r"messages\[0\].role' is required"),
    ({"messages": ["hi"]}, r"messages\[0\]' must be an object"),
    ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\].content' must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "list of text parts"),
    ({"messages": [{"role": "user", "tool_calls": []}]}, "only an assistant message"),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, r"tool_calls' must be a list"),
    ({"messages": [{"role": "user", "content": "a", "name": 3}]}, r"messages\[0\].name"),
    ({"messages": [{"role": "tool", "tool_call_id": None}]}, r"messages\[0\].tool_call_id"),
    ({"max_tokens": "2"}, "'max_tokens' must be a positive integer"),
    ({"max_tokens": 2.0}, "'max_tokens' must be a positive integer"),
    ({"max_tokens": False}, "'max_tokens' must be a positive integer"),
    ({"max_tokens": LIMIT + 1}, "per-call limit"),
    ({"max_completion_tokens": -3}, "'max_completion_tokens' must be a positive integer"),
    ({"n": 2}, "'n' must be 1"),
    ({"n": "1"}, "'n' must be 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "'stop' must be a string or up to 4"),
    ({"stop": [3]}, "'stop' must be a string or up to 4"),
    ({"stop": {"s": 1}}, "'stop' must be a string or up to 4"),
    ({"tools": {"name": "f"}}, "'tools' must be a list of objects"),
    ({"tools": ["f"]}, "'tools' must be a list of objects"),
    ({"logprobs": 1}, "'logprobs' must be a boolean"),
    ({"top_logprobs": 2}, "'top_logprobs' is not supported"),
    ({"stream": 0.0}, "'stream' must be a boolean"),
]


@pytest.mark.parametrize(("body", "why"), CHAT_GARBAGE, ids=[w for _, w in CHAT_GARBAGE])
def test_chat_garbage_is_refused_naming_the_field(body: dict[str, Any], why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        chat_request({**CHAT, **body}, LIMIT)


COMPLETION_GARBAGE: list[tuple[dict[str, Any], str]] = [
    ({}, "'prompt' must be a non-empty string or a list of token ids"),
    ({"prompt": ""}, "'prompt' must be a non-empty string"),
    ({"prompt": [1, -2]}, "'prompt' must be a non-empty string"),
    ({"prompt": [1, True]}, "'prompt' must be a non-empty string"),
    ({"prompt": [[1, 2]]}, "'prompt' must be a non-empty string"),
    ({"prompt": "x", "logprobs": 5}, "'logprobs'"),
    ({"prompt": "x", "logprobs": True}, "'logprobs'"),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be a positive integer"),
    ({"prompt": "x", "stream_options": {"include_usage": "no"}}, "include_usage"),
]


@pytest.mark.parametrize(
    ("body", "why"), COMPLETION_GARBAGE, ids=[w for _, w in COMPLETION_GARBAGE]
)
def test_completion_garbage_is_refused_naming_the_field(body: dict[str, Any], why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        completion_request(body, LIMIT)


def test_openai_bodies_a_client_sends_come_through() -> None:
    call = chat_request(
        {
            **CHAT,
            "model": "policy",
            "temperature": 0.7,
            "user": "me",
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "stop": "\n",
            "stream": True,
            "stream_options": None,
            "logprobs": None,
            "n": 1,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none",
        },
        LIMIT,
    )
    assert (call.max_tokens, call.stop, call.stream, call.include_usage) == (5, ["\n"], True, False)
    assert call.tools and not call.parse_tools and not call.logprobs
    assert call.messages == [{"role": "user", "content": "2+3?"}]
    sent = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        },
        {"role": "user", "content": None, "metadata": {"x": 1}},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c"}],
            "reasoning_content": "r",
        },
        {"role": "tool", "content": "4", "tool_call_id": "c", "name": "add"},
        {"role": "user"},
    ]
    assert chat_request({"messages": sent}, LIMIT).messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": ""},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c"}],
            "reasoning_content": "r",
        },
        {"role": "tool", "content": "4", "tool_call_id": "c", "name": "add"},
        {"role": "user"},
    ]
    text = completion_request({"prompt": "2+3=", "logprobs": 0, "stop": None}, LIMIT)
    assert (text.prompt_text, text.prompt_ids, text.logprobs, text.stop) == ("2+3=", None, True, [])
    ids = completion_request({"prompt": [1, 2], "max_tokens": LIMIT}, LIMIT)
    assert (ids.prompt_ids, ids.max_tokens, ids.logprobs) == ([1, 2], LIMIT, False)
