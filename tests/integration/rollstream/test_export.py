"""A trained version out as a Hugging Face model: ``rollstream export`` on a real SeaweedFS
store, and the complete directory an HTTP engine is handed for each version. Both must
load with ``from_pretrained`` and give the logits of the weights that were published."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.trainer_runs import s3_toml
from support.weight_states import store_for
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import S3Config
from core.model_files import write_model_files
from core.models import BOS_ID, SEP_ID, TinyTokenizer, build_tiny_llama
from producers.config import EngineConfig, RolloutConfig
from producers.engine.backends import MODEL_FILES_DIR, http_backend
from producers.engine.engine import Engine
from producers.engine.server import ServerThread
from rollstream.cli.main import main
from rollstream.runs.export import PROVENANCE_NAME
from weights.writer import DeltaWriter

PROMPT = [BOS_ID, 6, 7, 4, 8, SEP_ID]  # <bos>12+3<sep>


def trained_copy(seed: int = 0) -> torch.nn.Module:
    """The tiny model with a few parameters moved, as a training step would (ties kept)."""
    model = build_tiny_llama(seed=seed)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layers.0" in name or "embed" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits


def write_config(tmp_path: Path, s3: S3Config, run: str) -> Path:
    path = tmp_path / "rollstream.toml"
    path.write_text(
        f'run_id = "{run}"\nstate_dir = "{tmp_path / "state"}"\n\n[s3]\n{s3_toml(s3)}\n'
        "[weights]\nallow_unsigned = true\n"
    )
    return path


def test_export_writes_a_model_that_transformers_loads_and_generates_with(
    s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    run = unique_name("export")
    base, trained = build_tiny_llama(seed=0), trained_copy()
    writer = DeltaWriter(store_for(s3_config, run), base_every=10)
    writer.publish(base.state_dict())  # v0: a base
    writer.publish(trained.state_dict())  # v1: a delta on it
    config = write_config(tmp_path, s3_config, run)

    def export(*args: str, code: int = 0) -> str:
        result = CliRunner().invoke(main, ["--config", str(config), "export", *args])
        assert result.exit_code == code, result.output + repr(result.exception)
        return result.output

    out = tmp_path / "model"
    assert "v1 of run" in export("--out", str(out))  # the newest, as published (float32)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(loaded), logits(trained))
    assert not torch.equal(logits(loaded), logits(base))
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "<bos>12+3<sep>"
    assert tokenizer.encode(text, add_special_tokens=False) == TinyTokenizer().encode(text)
    generated = loaded.generate(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, len(PROMPT) + 3)
    assert tokenizer.decode(generated[0]).startswith(text)
    provenance = json.loads((out / PROVENANCE_NAME).read_text())
    assert provenance["run_id"] == run and provenance["version"] == 1

    # an older version, cast for release; the run named as an argument
    old = tmp_path / "v0-bf16"
    assert "v0 of run" in export(run, "--version", "0", "--dtype", "bfloat16", "--out", str(old))
    exported = AutoModelForCausalLM.from_pretrained(old, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in exported.parameters())
    cast = build_tiny_llama(seed=0)
    for p in cast.parameters():
        p.data = p.data.to(torch.bfloat16)
    assert torch.equal(logits(exported), logits(cast))

    # bad input: a clear error, nothing written or overwritten
    assert "not an empty directory" in export("--out", str(out), code=1)
    assert "version 7" in export("--version", "7", "--out", str(tmp_path / "x"), code=1)
    assert "is not a torch floating-point dtype" in export(
        "--dtype", "int8", "--out", str(tmp_path / "x"), code=1
    )
    wrong = export("--model", "tiny:hidden_size=32", "--out", str(tmp_path / "x"), code=1)
    assert "does not fit model" in wrong
    store = store_for(s3_config, run)
    store.delete([o.key for o in store.objects(version=1) if o.name != "manifest.json"])
    assert "refused" in export("--version", "1", "--out", str(tmp_path / "x"), code=1)
    assert not (tmp_path / "x").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(trained))


def test_an_http_engine_is_handed_a_directory_from_pretrained_loads(tmp_path: Path) -> None:
    """What the producer writes for an engine behind SGLang's HTTP API is a complete
    checkpoint: weights, config, generation config, tokenizer."""
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer(), seed=0)
    trained = trained_copy()
    weights_dir = tmp_path / "weights"

    async def hand_over() -> str:
        rollout = RolloutConfig(engine_url=server.url)
        backend = await http_backend(
            rollout, EngineConfig(model="tiny"), weights_dir / "p0", tmp_path
        )
        try:
            assert isinstance(backend.tokenizer, TinyTokenizer)  # the served model's
            await backend.load_version(3, trained.state_dict())
            return (await backend.model_info())["weight_version"]
        finally:
            await backend.aclose()

    with ServerThread(engine, weights_dir=weights_dir) as server:
        assert asyncio.run(hand_over()) == "3"
    version_dir = weights_dir / "p0" / "v3"
    template = write_model_files("tiny", tmp_path / "expected")
    assert set(template) <= {p.name for p in version_dir.iterdir()}
    assert (weights_dir / "p0" / MODEL_FILES_DIR).is_dir()
    loaded = AutoModelForCausalLM.from_pretrained(version_dir)
    assert torch.equal(logits(loaded), logits(trained))
    assert torch.equal(logits(engine.model), logits(trained))  # the engine loaded the same
    assert AutoTokenizer.from_pretrained(version_dir).decode(PROMPT) == "<bos>12+3<sep>"


@pytest.mark.parametrize("spec", ["tiny:seed=3", "tiny:hidden_size=32,num_heads=2"])
def test_the_tiny_models_files_match_the_model_built_from_its_spec(spec: str, tmp_path) -> None:
    from core.models import load_model

    write_model_files(spec, tmp_path)
    model = load_model(spec)
    model.save_pretrained(tmp_path)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path)), logits(model))


def test_a_lora_version_is_exported_merged_and_as_the_adapter_peft_loads(
    s3_config: S3Config, unique_name, tmp_path: Path
) -> None:
    from peft import PeftModel

    from core.config import LoraConfig
    from core.models import adapter_tensor_names, load_model

    run = unique_name("export-lora")
    lora = LoraConfig(rank=4, alpha=8.0)
    model = load_model("tiny", lora=lora)
    names = adapter_tensor_names(model)
    writer = DeltaWriter(store_for(s3_config, run), adapter_tensors=names)
    writer.publish(model.state_dict())  # v0: the base, B = 0
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in names:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    writer.publish(model.state_dict())  # v1: an adapter
    config = write_config(tmp_path, s3_config, run)

    def export(*args: str, code: int = 0) -> str:
        result = CliRunner().invoke(main, ["--config", str(config), "export", *args])
        assert result.exit_code == code, result.output + repr(result.exception)
        return result.output

    assert "holds a LoRA adapter" in export("--out", str(tmp_path / "x"), code=1)
    assert not (tmp_path / "x").exists()
    config.write_text(config.read_text() + "\n[lora]\nrank = 4\nalpha = 8.0\n")
    out, base = tmp_path / "merged", tmp_path / "base"
    listing = export("--out", str(out))
    assert "adapter/adapter_model.safetensors" in listing
    export("--version", "0", "--out", str(base))
    merged = AutoModelForCausalLM.from_pretrained(out)  # a plain model: no PEFT names
    assert not any("lora" in name for name in merged.state_dict())
    assert torch.allclose(logits(merged), logits(model), atol=1e-5)
    assert not torch.allclose(logits(merged), logits(build_tiny_llama(seed=0)), atol=1e-3)
    # the adapter on the plain base, as PEFT loads it, gives the same model
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), out / "adapter"
    )
    assert torch.allclose(logits(with_adapter), logits(model), atol=1e-5)
    provenance = json.loads((out / PROVENANCE_NAME).read_text())
    assert provenance["version"] == 1 and provenance["lora"]["rank"] == 4
