"""A small Hugging Face model with a real chat tokenizer, built and saved locally.

The tokenizer is a ``tokenizers`` word-level vocabulary (chat markers, roles, a few words,
the digits one token each) wrapped as a ``PreTrainedTokenizerFast`` with a ChatML-style
chat template; the model is the tiny Llama at that vocabulary size. Both go through
``save_pretrained``, so every role loads them as it would a user's model directory.
"""

from __future__ import annotations

from pathlib import Path

from core.models import build_tiny_llama

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
WORDS = ("system", "user", "assistant", "copy", "the", "first", "digit", "twice")
VOCAB = ("<pad>", "<unk>", IM_START, IM_END, *WORDS, *"0123456789")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def save_chat_model(directory: Path, seed: int = 0) -> Path:
    """``directory`` holding config, generation config, safetensors weights and a chat
    tokenizer whose end-of-turn marker is the end-of-sequence token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
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
        chat_template=CHAT_TEMPLATE,
    )
    model = build_tiny_llama(seed=seed, vocab_size=len(VOCAB))
    eos = VOCAB.index(IM_END)
    model.config.bos_token_id = None
    model.config.eos_token_id = eos
    model.config.pad_token_id = 0
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
