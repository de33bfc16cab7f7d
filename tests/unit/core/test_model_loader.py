"""One model spec, one loader: every role builds the same model with the same numerics.

The engine (``producers.engine.engine.engine_from_config``), the old-logit service
(``streams.oldlogits.OldLogitEngine``) and the trainer (``core.models.load_model`` in
float32 as ``consumers.trainer`` does, wrapped by ``consumers.train_engine.TrainEngine``) each
build their model through their own code from the same spec; with the same weights and
dtype their log-probs of the same tokens must be bit-identical. No Kafka or S3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from support.synthetic import synthetic_groups

from consumers.batching import pack
from consumers.batching import response_logprobs as trainer_logprobs
from consumers.config import TrainerConfig
from consumers.train_engine import TrainEngine
from core.config import ConfigurationError
from core.logprobs import response_logprobs_tensor
from core.models import (
    MODEL_ALIASES,
    SMOLLM2,
    ModelSpec,
    TinyTokenizer,
    build_tiny_llama,
    load_model,
    load_tokenizer,
    model_directory,
    parse_model_spec,
)
from producers.config import EngineConfig
from producers.engine.engine import engine_from_config
from rollstream.config.profiles import ProfileConfig
from rollstream.config.settings import load_config
from schemas.trajectory import Trajectory
from streams.config import OldLogitsConfig
from streams.oldlogits import OldLogitEngine
from streams.snapshots import InMemorySource, SnapshotStore

KWARGS_SPEC = "tiny:hidden_size=32,num_layers=3,seed=3"
CHECKPOINT_SEED = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face checkpoint directory of the tiny model with seed 5."""
    directory = tmp_path_factory.mktemp("models") / "tiny-seed5"
    build_tiny_llama(seed=CHECKPOINT_SEED).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def trajectories() -> list[Trajectory]:
    groups = synthetic_groups(3, group_size=3, prompt_len=4, response_len=7, seed=11)
    return [t for g in groups for t in g]


def pairs_of(trajectories: list[Trajectory]) -> list[tuple]:
    return [(t.prompt_ids, t.response_ids) for t in trajectories]


def logprobs(model, pairs, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode():
        return response_logprobs_tensor(model, pairs, dtype)[0]


# --- each role's own construction -------------------------------------------------------


def engine_model(spec: str, dtype: str, cache_dir: Path):
    """The producers' engine as ``rollstream serve`` and the worker build it."""
    return engine_from_config(EngineConfig(model=spec, dtype=dtype), cache_dir)


def oldlogit_service(spec: str, dtype: str, cache_dir: Path, states=None) -> OldLogitEngine:
    """The stream worker's old-logit engine (``streams.faust.app``), versions from ``states``."""
    config = OldLogitsConfig(model=spec, dtype=dtype)
    store = None
    if states is not None:
        store = SnapshotStore(
            InMemorySource(states), budget_bytes=1 << 30, dtype=getattr(torch, dtype)
        )
    return OldLogitEngine(config, store, cache_dir=cache_dir)


def trainer_engine(spec: str, dtype: str, cache_dir: Path) -> tuple[TrainEngine, TrainerConfig]:
    """The trainer's model: float32 from the one loader (``Trainer._build``), cast to
    bf16 by DeepSpeed when ``engine.bf16``."""
    config = TrainerConfig.model_validate(
        {"model": spec, "engine": {"accelerator": "cpu", "bf16": dtype == "bfloat16"}}
    )
    model = load_model(config.model.spec, "float32", cache_dir=cache_dir)
    return TrainEngine(model, config.engine, frozen_copies=1), config


# --- bit-identical numerics across roles ------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["tiny", KWARGS_SPEC, "checkpoint"])
def test_roles_give_bit_identical_logprobs(
    which: str, dtype: str, checkpoint: Path, trajectories: list[Trajectory], tmp_path: Path
) -> None:
    spec = str(checkpoint) if which == "checkpoint" else which
    torch_dtype = getattr(torch, dtype)
    pairs = pairs_of(trajectories)

    engine = engine_model(spec, dtype, tmp_path)
    train, train_config = trainer_engine(spec, dtype, tmp_path)
    service = oldlogit_service(spec, dtype, tmp_path, states={0: train.state_dict()})

    models = {
        "engine": engine.model,
        "old-logits": service.model,
        "trainer": train.module,
        "trainer-frozen": train.frozen_copy(),  # EWMA proximal / KL reference
    }
    reference = dict(models["trainer"].named_buffers()) | models["trainer"].state_dict()
    for role, model in models.items():
        assert next(model.parameters()).dtype == torch_dtype, role
        tensors = dict(model.named_buffers()) | model.state_dict()  # rotary buffers too
        assert tensors.keys() == reference.keys(), role
        for name, tensor in reference.items():
            assert tensors[name].dtype == tensor.dtype, (role, name)
            assert torch.equal(tensors[name], tensor), (role, name)

    expected = logprobs(engine.model, pairs, torch_dtype)
    for role in ("old-logits", "trainer", "trainer-frozen"):
        assert torch.equal(logprobs(models[role], pairs, torch_dtype), expected), role

    # The trainer's logp_new: through DeepSpeed, with grad, from the packed batch.
    logp_new = trainer_logprobs(
        train.engine, pack(trajectories), temperature=train_config.model.temperature
    )
    assert torch.equal(logp_new.detach(), expected)

    # The old-logit service's logp_old: the trainer's published state dict of version 0
    # through the snapshot store and the service's batches.
    found = service.compute(trajectories)
    for row, (traj, result) in enumerate(zip(trajectories, found, strict=True)):
        assert result.status == "exact"
        width = traj.num_response_tokens
        assert torch.equal(torch.from_numpy(result.logp_old), expected[row, :width])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_directory_loads_the_saved_model(
    dtype: str, checkpoint: Path, trajectories: list[Trajectory], tmp_path: Path
) -> None:
    torch_dtype = getattr(torch, dtype)
    pairs = pairs_of(trajectories)
    from_dir = load_model(str(checkpoint), dtype)
    from_code = load_model(f"tiny:seed={CHECKPOINT_SEED}", dtype)
    assert torch.equal(
        logprobs(from_dir, pairs, torch_dtype), logprobs(from_code, pairs, torch_dtype)
    )

    engine = engine_model(str(checkpoint), dtype, tmp_path)
    assert engine.model_path == str(checkpoint) == engine.tokenizer_path
    assert engine.tokenizer is None  # save_pretrained of a model alone: no tokenizer files
    assert model_directory(str(checkpoint)) == checkpoint


def test_load_model_dtype_device_and_mode() -> None:
    model = load_model("tiny-llama", "bfloat16", device="cpu")
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # parameters only, as DeepSpeed casts the trainer's module: buffers stay float32
    assert {b.dtype for b in model.buffers()} == {torch.float32}
    big = load_model(KWARGS_SPEC)
    assert big.config.hidden_size == 32 and big.config.num_hidden_layers == 3
    assert torch.equal(
        big.model.embed_tokens.weight,
        build_tiny_llama(seed=3, hidden_size=32, num_layers=3).model.embed_tokens.weight,
    )
    with pytest.raises(ValueError, match="floating-point dtype"):
        load_model("tiny", "int64")


def test_engine_reports_the_canonical_spec(tmp_path: Path) -> None:
    engine = engine_from_config(EngineConfig(model="tiny-llama"), tmp_path)
    assert engine.model_path == "tiny" and engine.tokenizer_path is None
    assert isinstance(engine.tokenizer, TinyTokenizer)
    assert isinstance(load_tokenizer("tiny"), TinyTokenizer)
    assert model_directory("tiny") is None


# --- the grammar ------------------------------------------------------------------------


def test_spec_grammar_and_canonical_names() -> None:
    assert parse_model_spec("tiny") == ModelSpec("tiny")
    spec = parse_model_spec(" tiny: seed=3 , hidden_size=128,tie_word_embeddings=FALSE ")
    assert spec.tiny_kwargs == {"seed": 3, "hidden_size": 128, "tie_word_embeddings": False}
    assert spec.name == "tiny:hidden_size=128,seed=3,tie_word_embeddings=false"
    assert parse_model_spec(spec.name) == spec  # the canonical name parses back
    assert parse_model_spec(SMOLLM2).kind == "smollm2"
    for alias, canonical in MODEL_ALIASES.items():
        assert parse_model_spec(alias).name == canonical
    assert parse_model_spec("tiny-llama:seed=1").name == "tiny:seed=1"
    relative = parse_model_spec("./ckpt", check_path=False)
    assert relative.kind == "path" and relative.name == "./ckpt"
    assert parse_model_spec(relative.name, check_path=False) == relative


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown model spec"),
        ("gpt2", "unknown model spec"),
        ("tiny-lama", "unknown model spec"),
        ("tiny:oops", "expected key=value"),
        ("tiny:", "expected key=value"),
        ("tiny:seed=", "expected key=value"),
        ("tiny:hiden_size=8", "not an option of the tiny model"),
        ("tiny:seed=1.5", "seed must be an integer"),
        ("tiny:tie_word_embeddings=yes", "must be true or false"),
        ("tiny:seed=1,seed=2", "given twice"),
        ("smollm2:q=4", "takes no options"),
        ("./no/such/checkpoint", "is not a directory"),
        ("org/name:trust=yes", "not a Hub option"),
        ("org/name:trust_remote_code=maybe", "must be true or false"),
    ],
)
def test_bad_specs_are_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_spec(spec)
    with pytest.raises(ValueError, match=message):
        load_model(spec)


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        parse_model_spec(str(tmp_path))
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(str(tmp_path))


# --- the config sections ----------------------------------------------------------------


def test_every_section_takes_the_same_spec_and_stores_it_canonical() -> None:
    assert EngineConfig(model="tiny-llama").model == "tiny"
    assert OldLogitsConfig(model="smollm2").model == SMOLLM2
    assert TrainerConfig.model_validate({"model": "smollm2-135m"}).model.spec == SMOLLM2
    nested = TrainerConfig.model_validate({"model": {"spec": "tiny:seed=1", "temperature": 0.5}})
    assert nested.model.spec == "tiny:seed=1" and nested.model.temperature == 0.5
    assert ProfileConfig(model="tiny-llama").model == "tiny"
    # a checkpoint is checked when loaded, not when a config naming it is read
    assert EngineConfig(model="./elsewhere/ckpt/").model == "./elsewhere/ckpt"  # normalised
    assert EngineConfig(model="org/name@v1").model == "org/name@v1"  # a Hub id


@pytest.mark.parametrize(
    "build",
    [
        lambda: EngineConfig(model="gpt2"),
        lambda: OldLogitsConfig(model="tiny:oops"),
        lambda: TrainerConfig.model_validate({"model": "smollm2:x"}),
        lambda: TrainerConfig.model_validate({"model": {"source": "tiny"}}),  # the old key
        lambda: ProfileConfig(model="smollm3"),
        lambda: OldLogitsConfig(source="seeded", model=SMOLLM2),
    ],
)
def test_sections_refuse_bad_specs(build) -> None:
    with pytest.raises(ValidationError):
        build()


@pytest.mark.parametrize(("model", "dtype"), [("tiny:seed=2", "float32"), ("smollm2", "bfloat16")])
def test_the_profile_gives_every_role_the_same_spec(model: str, dtype: str) -> None:
    precision = "bf16" if dtype == "bfloat16" else "auto"
    config = load_config(None, profile={"model": model, "precision": precision})
    engine, old, trainer = config.producers.engine, config.streams.old_logits, config.trainer
    canonical = parse_model_spec(model).name
    assert engine.model == old.model == trainer.model.spec == canonical
    assert engine.dtype == old.dtype == dtype
    assert trainer.engine.bf16 == (dtype == "bfloat16")


# --- a Hub id from the local Hugging Face cache -------------------------------------------


def cache_snapshot(cache: Path, repo_id: str, commit: str, source: Path, ref: str) -> None:
    """``source``'s files laid out as the Hub cache holds a download of ``repo_id``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


def test_a_hub_id_loads_from_the_local_cache(
    checkpoint: Path, trajectories: list[Trajectory], tmp_path: Path, monkeypatch
) -> None:
    from huggingface_hub import constants

    from rollstream.up.plan import check_models

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    commit = "0123456789abcdef0123456789abcdef01234567"
    cache_snapshot(cache, "acme/tiny-seed5", commit, checkpoint, "main")
    spec = parse_model_spec("acme/tiny-seed5@" + commit + ":trust_remote_code=false")
    assert (spec.kind, spec.repo_id, spec.revision) == ("hub", "acme/tiny-seed5", commit)
    assert spec.name == "acme/tiny-seed5@" + commit and parse_model_spec(spec.name) == spec
    assert parse_model_spec("acme/x:trust_remote_code=true").trust_remote_code

    pairs = pairs_of(trajectories)
    expected = logprobs(load_model(str(checkpoint)), pairs, torch.float32)
    for name in ("acme/tiny-seed5", spec.name):  # the cache's main, and a pinned commit
        assert model_directory(name) == cache / "models--acme--tiny-seed5/snapshots" / commit
        assert torch.equal(logprobs(load_model(name), pairs, torch.float32), expected)

    # What is not in the cache is refused with the fetch command, never fetched.
    with pytest.raises(ValueError, match=r"acme/tiny-seed5 at revision v2 .*hf download"):
        load_model("acme/tiny-seed5@v2")
    # A relative directory that reads as a Hub id is named in the error.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "local").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"write './acme/local'"):
        model_directory("acme/local")

    # `up` resolves every role's model before it starts anything.
    config = load_config(None, profile={"model": "acme/tiny-seed5"})
    check_models(config)
    missing = load_config(None, profile={"model": "acme/elsewhere"})
    with pytest.raises(ConfigurationError, match="acme/elsewhere at revision main"):
        check_models(missing)


def test_a_directory_is_built_once_and_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    from core.models import built_once

    builds: list[Path] = []

    def build(staging: Path) -> None:
        builds.append(staging)
        (staging / "config.json").write_text("{}")

    target = tmp_path / "cache" / "thing"
    assert built_once(target, build) == target
    assert built_once(target, build) == target
    assert len(builds) == 1 and (target / "config.json").read_text() == "{}"

    def crash(staging: Path) -> None:
        (staging / "half.json").write_text("{")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        built_once(tmp_path / "cache" / "other", crash)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["thing"]  # no staging


def test_the_tiny_models_files_are_written_once_per_spec_into_the_cache(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from core.model_files import tiny_model_files, write_model_files

    cache = tmp_path / "cache"
    small = parse_model_spec("tiny:hidden_size=32,num_heads=2")
    cached = tiny_model_files(small, cache)
    assert tiny_model_files(parse_model_spec("tiny:num_heads=2,hidden_size=32"), cache) == cached
    assert tiny_model_files(parse_model_spec("tiny"), cache) != cached
    stamp = (cached / "config.json").stat().st_mtime_ns
    names = write_model_files(small, tmp_path / "run" / "model-files", cache)
    assert (cached / "config.json").stat().st_mtime_ns == stamp  # copied, not rewritten
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(names)
    config = AutoConfig.from_pretrained(tmp_path / "run" / "model-files")
    assert (config.hidden_size, config.num_attention_heads) == (32, 2)
