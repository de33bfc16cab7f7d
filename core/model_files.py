"""The files of a Hugging Face checkpoint other than its weights, for any model spec.

A directory of weights alone is not a model anyone else can load: ``from_pretrained``, a
real SGLang server's ``/update_weights_from_disk`` and ``AutoTokenizer`` need the
config, the generation config and the tokenizer beside them. ``write_model_files`` writes
those for the spec a run trains, so that its weights plus these files make a complete
checkpoint (``rollstream export``, the versions handed to an HTTP engine):

* a checkpoint directory (SmolLM2, a local path): its own files, weight files left out;
* the tiny model, which is built from code: its ``LlamaConfig``, a generation config, and
  its 16-token vocabulary as a ``PreTrainedTokenizerFast`` (``tiny_tokenizer``) that
  encodes and decodes as ``TinyTokenizer`` does. Writing them imports transformers' Llama
  (seconds of CPU), so they are written once per machine into the cache
  (``tiny_model_files``) and copied from there.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from core.config import default_cache_dir
from core.models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SEP_ID,
    TINY_CHAT_TEMPLATE,
    TINY_VOCAB,
    ModelSpec,
    build_tiny_llama,
    built_once,
    model_directory,
    parse_model_spec,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

#: Suffixes of weight files, which a template never copies (the version brings its own).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def is_weight_file(name: str) -> bool:
    """Weights or a shard index of weights (``model.safetensors.index.json``)."""
    return name.endswith(WEIGHT_SUFFIXES) or ".safetensors.index" in name or ".bin.index" in name


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny model's vocabulary as a Hugging Face fast tokenizer: one token per digit or
    ``+``, whitespace ignored, the four special tokens matched whole, decoded without
    separators; chat messages render as ``TinyTokenizer`` renders them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(TINY_VOCAB)}))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), "isolated")]
    )
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=TINY_VOCAB[PAD_ID],
        bos_token=TINY_VOCAB[BOS_ID],
        eos_token=TINY_VOCAB[EOS_ID],
        sep_token=TINY_VOCAB[SEP_ID],
        chat_template=TINY_CHAT_TEMPLATE,
    )
    return tokenizer


def write_model_files(
    spec: str | ModelSpec, directory: Path, cache_dir: Path | None = None
) -> list[str]:
    """Write the non-weight files of ``spec``'s checkpoint into ``directory`` (created);
    the names written."""
    parsed = parse_model_spec(spec)
    directory.mkdir(parents=True, exist_ok=True)
    source = model_directory(parsed, cache_dir) or tiny_model_files(parsed, cache_dir)
    for item in sorted(source.iterdir()):
        if item.is_file() and not is_weight_file(item.name):
            shutil.copy2(item, directory / item.name)
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def tiny_model_files(spec: ModelSpec, cache_dir: Path | None = None) -> Path:
    """The cached directory of the tiny model's files for ``spec``, written on first use;
    keyed by the spec and the transformers version (which writes them)."""
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(f"{spec.name}\0{version}".encode()).hexdigest()[:16]
    target = Path(cache_dir or default_cache_dir()) / "model-files" / f"tiny-{key}"

    def write(staging: Path) -> None:
        from transformers import GenerationConfig

        build_tiny_llama(**spec.tiny_kwargs).config.save_pretrained(staging)
        GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
        ).save_pretrained(staging)
        tiny_tokenizer().save_pretrained(staging)

    return built_once(target, write)
