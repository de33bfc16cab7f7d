"""Tokenizers of three tool-calling model families, built here (nothing is fetched): a
byte-level vocabulary (any text encodes) with each family's marker tokens, and a short
chat template modeled on the family's real one (Qwen2.5 for Hermes, Llama 3.1's JSON
tool calling, Mistral 7B v0.3): the same tool sections, call rendering and tool-result
roles, without the date lines, system-prompt variants and builtin tools.

And a tool-calling model small enough to train in a test (``save_tool_agent_model``): the
tiny chat Llama, word-level, warm-started on how to call one tool and read its result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function %}
{{- "\n<tool_call>\n" }}{"name": "{{ tool_call.name }}", "arguments": \
{% if tool_call.arguments is string %}{{ tool_call.arguments }}\
{% else %}{{ tool_call.arguments | tojson }}{% endif %}}
{{- "\n</tool_call>" }}
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == "user" and loop.first and tools %}\
<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}. Do not use variables.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception("This model only supports single tool-calls at once!") }}
{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}\
<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ tool_call.name }}", "parameters": {{ tool_call.arguments | tojson }}}\
{% if builtin_tools is defined %}<|eom_id|>{% else %}<|eot_id|>{% endif %}
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
{%- if message.role == "user" %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == "user" %}
{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS] {{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS] [
{%- for tool_call in message.tool_calls %}
{%- if tool_call.id is not defined or tool_call.id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}{"name": "{{ tool_call.function.name }}", "arguments": \
{{ tool_call.function.arguments | tojson }}, "id": "{{ tool_call.id }}"}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]{{ eos_token }}
{%- elif message.role == "tool" %}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == "assistant" %} {{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""


@dataclass(frozen=True)
class Family:
    """One family's template and tokens: ``special`` are dropped when a text is decoded
    without special tokens, ``plain`` (Qwen's ``<tool_call>``) are kept."""

    template: str
    bos: str
    eos: str
    special: tuple[str, ...]
    plain: tuple[str, ...] = ()


FAMILIES = {
    "hermes": Family(
        HERMES_TEMPLATE,
        "<|endoftext|>",
        "<|im_end|>",
        ("<|im_start|>",),
        ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    "llama3": Family(
        LLAMA3_TEMPLATE,
        "<|begin_of_text|>",
        "<|eot_id|>",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
    ),
    "mistral": Family(
        MISTRAL_TEMPLATE,
        "<s>",
        "</s>",
        (
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
    ),
}


def family_tokenizer(name: str, template: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer of family ``name`` (``FAMILIES``): one token per byte, the family's
    markers one token each; ``template`` replaces its chat template."""
    family = FAMILIES[name]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=family.bos,
        eos_token=family.eos,
        additional_special_tokens=list(family.special),
        chat_template=family.template if template is None else template,
    )
    tokenizer.add_tokens(list(family.plain))
    return tokenizer


# A tool-calling chat model small enough to train in a test: the starter's word-level chat
# vocabulary with a Hermes-style call written in four words. ``<tool_call>`` in the template
# is what the gateway's ``tool_call_parser = "auto"`` recognises; the word-level decoder joins
# the words without spaces, so the call decodes to ``{"name":"lookup","arguments":{}}``.
LOOKUP_CALL_WORDS = ('{"name":', '"lookup",', '"arguments":', "{}}")
TOOL_AGENT_VOCAB = (
    "<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "tool",
    "<tool_call>", *LOOKUP_CALL_WORDS, "</tool_call>", *"0123456789",
)  # fmt: skip
TOOL_AGENT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant"
    "{% for call in message['tool_calls'] %}"
    ' <tool_call> {"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}} </tool_call>"
    "{% endfor %}<|im_end|>"
    "{% else %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
LOOKUP_CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "lookup", "arguments": {}},
}


def save_tool_agent_model(
    directory: Path, seed: int = 0, warm_steps: int = 300, call_rate: float = 0.3
) -> Path:
    """The tiny chat model of ``TOOL_AGENT_VOCAB`` saved in ``directory``, warm-started on
    how to use ``lookup``, not on when: asked about three digits, it calls it about
    ``call_rate`` of the time and otherwise answers a digit at random; given its result, it
    answers that digit. That calling pays is left for reinforcement learning to find."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.cli.starter import save_chat_model

    save_chat_model(directory, seed, vocab=TOOL_AGENT_VOCAB, template=TOOL_AGENT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    rng = random.Random(seed)
    examples = [_warm_example(tokenizer, rng, call_rate) for _ in range(2000)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(warm_steps):
            batch = rng.sample(examples, 64)
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([x + [0] * (width - len(x)) for x, _ in batch])
            trained = torch.tensor([[i >= start for i in range(1, width)] for _, start in batch])
            trained &= ids[:, 1:] != 0
            logits = model(ids).logits[:, :-1]
            losses = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), ids[:, 1:], reduction="none"
            )
            loss = (losses * trained).sum() / trained.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(directory)
    return directory


def _warm_example(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, call_rate: float
) -> tuple[list[int], int]:
    """One answer to learn, as ``(ids, where the answer starts)``: a first answer (the call
    or a random digit) or an answer after ``lookup``'s result (that result)."""
    question = [{"role": "user", "content": "".join(rng.choices("0123456789", k=3))}]
    if rng.random() < 0.7:  # the harder part to learn: reading the result
        found = rng.choice("0123456789")
        asked = [*question, {"role": "assistant", "tool_calls": [LOOKUP_CALL]}]
        history = [*asked, {"role": "tool", "content": found}]
        answer = {"role": "assistant", "content": found}
    else:
        history = question
        if rng.random() < call_rate:
            answer = {"role": "assistant", "tool_calls": [LOOKUP_CALL]}
        else:
            answer = {"role": "assistant", "content": rng.choice("0123456789")}
    prompt = template_ids(tokenizer, history, add_generation_prompt=True)
    return template_ids(tokenizer, [*history, answer]), len(prompt)


def template_ids(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict], **options: bool
) -> list[int]:
    """``messages`` rendered by the chat template and tokenized, as the gateway does."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
