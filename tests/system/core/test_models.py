"""The shared models: the tiny Llama and the converted SmolLM2 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.models import build_tiny_llama, smollm2_checkpoint, smollm2_gguf_path


def test_tiny_llama_is_deterministic_and_small() -> None:
    a, b, c = build_tiny_llama(seed=3), build_tiny_llama(seed=3), build_tiny_llama(seed=4)
    params = sum(p.numel() for p in a.parameters())
    assert 120_000 < params < 140_000
    assert a.config.vocab_size == 16 and a.config.num_hidden_layers == 2
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.system
def test_smollm2_is_converted_once_to_bf16_safetensors(cache_dir: Path) -> None:
    """Uses the real cache: the first run converts (~30 s), later runs reuse it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2_gguf_path().suffix == ".gguf"
    path = smollm2_checkpoint(cache_dir)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert smollm2_checkpoint(cache_dir) == path
    assert weights.stat().st_mtime_ns == stamp  # reused, not rewritten

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert 130e6 < sum(unique.values()) < 140e6
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits.float()).all()


def test_the_tiny_tokenizer_serves_chat_in_its_own_tokens() -> None:
    """The default model answers chat calls: a user message renders as the digit tasks'
    prompt, so the policy the task trains is the one an agent talks to; its saved copy
    (what an HTTP engine loads) renders the same."""
    from core.model_files import tiny_tokenizer
    from core.models import load_tokenizer
    from producers.tasks.base import copy_first_digit_twice

    tokenizer = load_tokenizer("tiny")
    assert len(tokenizer) == 16 and len(load_tokenizer("tiny:vocab_size=32")) == 32
    first = [{"role": "system", "content": "copy the first digit twice"}]
    first.append({"role": "user", "content": "123"})
    ids = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    assert ids == copy_first_digit_twice(None).prompt([1, 2, 3]).ids  # type: ignore[arg-type]
    again = [*first, {"role": "assistant", "content": "11"}, {"role": "tool", "content": "4+5"}]
    text = tokenizer.apply_chat_template(again, add_generation_prompt=True, tokenize=False)
    assert text == "<bos>123<sep>11<eos>4+5<sep>"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    saved = tiny_tokenizer()
    assert saved.apply_chat_template(again, add_generation_prompt=True, tokenize=False) == text
    assert tokenizer.decode(tokenizer.encode("<15>1")) == "<15>1"  # an unnamed id, both ways
    with pytest.raises(ValueError, match="16"):
        tokenizer.encode("<16>")
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    with pytest.raises(Exception, match="cannot call tools"):
        tokenizer.apply_chat_template(first, tools=[tool])
