"""``rollstream init DIR``: a run of one's own, ready to try, before one's own model, data
and rewards are.

The directory holds what a run of one's own is made of, built on this machine with nothing
downloaded: a Hugging Face model directory with a chat tokenizer (``models/my-model``: the
tiny Llama at a 22-token vocabulary, random weights), a conversational JSONL dataset with
an eval file (``data/``: the user says three digits, the answer is the first one twice),
two reward functions written as for TRL's ``GRPOTrainer`` (``my_rewards.py``) and a
``rollstream.toml`` naming them. Replacing the model, the files and the functions with
one's own is the whole step from this run to a real one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import click

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
WORDS = ("system", "user", "assistant", "copy", "the", "first", "digit", "twice")
CHAT_VOCAB = ("<pad>", "<unk>", IM_START, IM_END, *WORDS, *"0123456789")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
SYSTEM_PROMPT = "copy the first digit twice"

REWARDS = '''"""Reward functions as TRL's GRPOTrainer calls them: the prompts, the completions
(conversational: a list holding the assistant's message), the completion ids and each of
the row's columns by name; one float per completion."""


def _text(completion):
    if isinstance(completion, list):
        completion = completion[-1]["content"]
    return "".join(str(completion).split())


def accuracy_reward(completions, answer, **kwargs):
    """Half a point for each answer digit in its place."""
    return [
        sum(0.5 for said, right in zip(_text(c), target) if said == right)
        for c, target in zip(completions, answer)
    ]


def format_reward(completions, **kwargs):
    """A tenth of a point for an answer of exactly two digits."""
    return [0.1 if len(t) == 2 and t.isdigit() else 0.0 for t in map(_text, completions)]
'''

CONFIG = """\
# A run of your own: your model, your data, your reward functions.
run_id = "my-grpo"

[profile]
model = "./models/my-model"        # a save_pretrained directory, or a Hub id in the local cache
name = "tiny"                      # batch sizes for this small model: drop the line for yours

[producers.rollout]
task = "file"
group_size = 8

[producers.rollout.task_options]
path = "data/train.jsonl"          # a "messages" column uses the model's chat template
eval_path = "data/test.jsonl"
system_prompt = "copy the first digit twice"
max_new_tokens = 2
rewards = [
  { function = "my_rewards:accuracy_reward" },
  { function = "my_rewards:format_reward" },
]

[producers.eval]
every_versions = 10

[trainer.engine]
lr_scheduler = "cosine"
warmup_steps = 5
decay_steps = 100

[up]
max_steps = 100

[tracking]
backends = ["tensorboard"]
"""


def save_chat_model(
    directory: Path,
    seed: int = 0,
    *,
    vocab: tuple[str, ...] = CHAT_VOCAB,
    template: str = CHAT_TEMPLATE,
) -> Path:
    """``directory`` holding config, generation config, safetensors weights and a chat
    tokenizer (a ``tokenizers`` word-level vocabulary wrapped as a
    ``PreTrainedTokenizerFast``, ChatML-style template) whose end-of-turn marker is the
    end-of-sequence token: every role loads it as it would a user's model directory.
    ``vocab`` must hold ``CHAT_VOCAB``'s first four tokens in its first four places."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from core.models import build_tiny_llama

    if vocab[:4] != CHAT_VOCAB[:4]:
        raise ValueError(f"a chat vocabulary starts with {CHAT_VOCAB[:4]}, not {vocab[:4]}")
    words = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    words.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=template,
    )
    model = build_tiny_llama(seed=seed, vocab_size=len(vocab))
    eos = vocab.index(IM_END)
    model.config.bos_token_id = None
    model.config.eos_token_id = eos
    model.config.pad_token_id = 0
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def digit_rows(rng: random.Random, count: int) -> list[dict[str, object]]:
    """``count`` chat rows: the user's three digits and the answer column."""
    rows: list[dict[str, object]] = []
    for _ in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        rows.append({"messages": [{"role": "user", "content": digits}], "answer": digits[0] * 2})
    return rows


def write_starter(directory: Path, seed: int = 0) -> list[Path]:
    """Write the starter run into ``directory`` (absent or empty); the files written."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise click.ClickException(f"{directory} exists and is not empty: name a new directory")
    rng = random.Random(seed)
    data = directory / "data"
    data.mkdir(parents=True)
    written = []
    for name, count in (("train.jsonl", 300), ("test.jsonl", 12)):
        path = data / name
        path.write_text("".join(json.dumps(row) + "\n" for row in digit_rows(rng, count)))
        written.append(path)
    for name, text in (("my_rewards.py", REWARDS), ("rollstream.toml", CONFIG)):
        (directory / name).write_text(text)
        written.append(directory / name)
    written.append(save_chat_model(directory / "models" / "my-model", seed=seed))
    return written


@click.command("init")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Seed of the model and the rows.")
def init(directory: Path, seed: int) -> None:
    """Write a run of one's own to try the commands with, in DIRECTORY (new or empty):
    rollstream.toml, my_rewards.py, data/train.jsonl and data/test.jsonl, and
    models/my-model (a small chat model built here, random weights). Run `rollstream
    --config rollstream.toml up` from DIRECTORY; then replace the model, the data and the
    functions with yours."""
    for path in write_starter(directory, seed):
        click.echo(path)
