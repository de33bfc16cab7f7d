"""LoRA policies: the one loader adds the same adapter in every role, versions published
as adapters on real SeaweedFS come back bit for bit, the old-logit service scores them
exactly as PEFT does from the adapter's own files, and k held versions cost one base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from support.lora import LORA, trained
from support.streams import rollout
from support.synthetic import synthetic_groups

from consumers.config import TrainerConfig
from consumers.step import StepRunner
from consumers.train_engine import TrainEngine
from core.config import LoraConfig, S3Config
from core.logprobs import PADDED_BATCH_ATOL
from core.models import adapter_tensor_names, load_model, save_adapter
from producers.engine.engine import Engine
from producers.engine.weights import AppliedTensors, load_state_dict_checked
from schemas.trajectory import Trajectory
from streams.config import OldLogitsConfig
from streams.oldlogits import OldLogitEngine
from streams.snapshots import SnapshotStore
from weights.follower import WeightFollower
from weights.store import WeightStore
from weights.writer import DeltaWriter

torch.set_num_threads(1)

TINY_VOCAB = 16


def test_the_adapter_leaves_the_model_unchanged_until_trained_and_alone_trains() -> None:
    plain, lora = load_model("tiny"), load_model("tiny", lora=LORA)
    ids = torch.randint(0, TINY_VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, lora(input_ids=ids).logits)
    names = adapter_tensor_names(lora)
    assert names and all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert {n for n, p in lora.named_parameters() if p.requires_grad} == set(names)
    # every role builds the same adapter: A is drawn from a fixed seed
    again = load_model("tiny", lora=LORA).state_dict()
    assert all(torch.equal(lora.state_dict()[n], again[n]) for n in names)
    with pytest.raises(ValueError, match="cannot add a LoRA adapter"):
        load_model("tiny", lora=LoraConfig(target_modules=["no_such_proj"]))


@pytest.mark.parametrize(
    "garbage",
    [
        {"rank": 0},
        {"alpha": 0},
        {"target_modules": []},
        {"target_modules": ["q_proj; rm"]},
        {"rank": "four"},
        {"dropout": 0.1},
    ],
)
def test_a_garbage_lora_config_is_refused(garbage: dict) -> None:
    with pytest.raises(ValidationError):
        LoraConfig(**garbage)


def test_old_logits_of_adapter_versions_are_peft_own_and_share_one_base(
    s3_config: S3Config, tmp_path: Path
) -> None:
    states = {v: trained(v) for v in range(4)}
    store = WeightStore.from_config(s3_config, "lora-run")
    writer = DeltaWriter(store, adapter_tensors=adapter_tensor_names(load_model("tiny", lora=LORA)))
    for version in range(4):
        writer.publish(states[version], version)

    snapshots = SnapshotStore(None, budget_bytes=1 << 30)
    follower = WeightFollower(store, on_version=snapshots.on_snapshot)
    for version in range(4):
        follower.sync(version)
    base_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    # four versions held: one base and four adapters, not four models
    assert snapshots.versions == [0, 1, 2, 3] and snapshots.bytes < 1.5 * base_bytes

    model = load_model("tiny", lora=LORA)
    engine = OldLogitEngine(OldLogitsConfig(), snapshots, lora=LORA)
    traj = rollout(model, states, [1, 5, 6], [(1, 4), (3, 5)], seed=3)
    whole = rollout(model, states, [1, 5, 6], [(3, 9)], seed=3)  # one segment, one pass
    (scored,) = engine.attach([traj])
    (scored_whole,) = engine.attach([whole])  # a batch of one
    assert scored.old_logits_status == scored_whole.old_logits_status == "exact"

    # PEFT's own loading of each version's adapter files, on the plain base model
    def peft_logp(version: int, traj: Trajectory) -> torch.Tensor:
        state = snapshots.get(version)
        assert state is not None
        adapter = save_adapter(state, LORA, tmp_path / f"v{version}", "tiny")
        peft_model = PeftModel.from_pretrained(load_model("tiny"), str(adapter)).eval()
        ids = torch.tensor([[*traj.prompt_ids.tolist(), *traj.response_ids.tolist()]])
        with torch.inference_mode():
            logp = torch.log_softmax(peft_model(input_ids=ids).logits.float(), dim=-1)[0]
        p = traj.num_prompt_tokens
        return torch.tensor(
            [logp[p + j - 1, int(token)].item() for j, token in enumerate(traj.response_ids)]
        )

    # a single pass is PEFT's, bit for bit
    assert torch.equal(torch.from_numpy(scored_whole.logp_old), peft_logp(3, whole))
    # segments are scored in passes of their own length: equal to the padded-batch tolerance
    got = torch.from_numpy(scored.logp_old)
    under_1, under_3 = peft_logp(1, traj), peft_logp(3, traj)
    assert torch.allclose(got[:4], under_1[:4], rtol=0, atol=PADDED_BATCH_ATOL)
    assert torch.allclose(got[4:], under_3[4:], rtol=0, atol=PADDED_BATCH_ATOL)
    # the adapters matter: version 1 scores the second segment differently
    assert (under_1[4:] - under_3[4:]).abs().max() > 1e-3


def test_the_engine_copies_only_the_adapter_of_each_version(
    s3_config: S3Config, unique_name
) -> None:
    states = {v: trained(v) for v in range(3)}
    store = WeightStore.from_config(s3_config, unique_name("lora-engine"))
    names = adapter_tensor_names(load_model("tiny", lora=LORA))
    writer = DeltaWriter(store, adapter_tensors=names)
    for version in range(3):
        writer.publish(states[version], version)
    snapshots: list = []
    follower = WeightFollower(store, on_version=snapshots.append)
    for version in range(3):
        follower.sync(version)

    model, applied = load_model("tiny", lora=LORA), AppliedTensors()
    copied = [load_state_dict_checked(model, s.state, applied) for s in snapshots]
    assert copied == [len(states[0]), len(names), len(names)]  # the base once, then adapters
    ids = torch.randint(0, TINY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    fresh = load_model("tiny", lora=LORA)
    fresh.load_state_dict(states[2])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)
    # a state whose tensors are new objects is copied whole, even with equal names
    assert load_state_dict_checked(model, dict(states[1]), applied) == len(states[1])

    # the engine swaps them the same way between batches
    engine = Engine(load_model("tiny", lora=LORA), model_path="tiny")
    for snapshot in snapshots:
        engine.update_weights(snapshot.state, str(snapshot.version)).result()
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, fresh(input_ids=ids).logits)
    assert engine.applied.changed(snapshots[-1].state) == {}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_deepspeed_trains_only_the_adapter(precision: str) -> None:
    config = TrainerConfig.model_validate(
        {"engine": {"lr": 1e-2, "zero_stage": 1, "bf16": precision == "bf16"}}
    )
    model = load_model(config.model.spec, lora=LORA)
    adapter = set(adapter_tensor_names(model))
    engine = TrainEngine(model, config.engine)
    runner = StepRunner(engine, config, pad_id=0)
    groups = synthetic_groups(4, model=load_model("tiny", lora=LORA), seed=1)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = [runner.train_step([[t for g in groups for t in g]]).metrics["loss/total"]]
    for _ in range(4):
        losses.append(runner.train_step([[t for g in groups for t in g]]).metrics["loss/total"])
    after = engine.state_dict()
    changed = {k for k in before if not torch.equal(after[k], before[k])}
    assert changed and changed <= adapter  # every frozen tensor is bit-for-bit the base's
    assert losses[-1] < losses[0]
    # the optimiser holds the adapter alone: its state is megabytes, not a model's
    optimised = sum(p.numel() for group in engine.optimizer.param_groups for p in group["params"])
    assert optimised == sum(before[k].numel() for k in adapter)
