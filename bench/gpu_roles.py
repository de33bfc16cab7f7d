"""The stream and the trainer on one accelerator, through their own classes.

Part of ``python -m bench.gpu_check`` (``--device cpu`` runs the same code on the CPU; a
test does). In one process, no Kafka or S3:

1. **Trainer.** ``consumers.train_engine.TrainEngine`` (DeepSpeed; NCCL on CUDA, gloo on
   the CPU; a world of one) around the model the trainer loads, in the run's dtype.
2. **Old logits of version 0.** The stream's ``streams.oldlogits.OldLogitEngine`` on the
   device, its ``SnapshotStore`` on the device with a budget of about one version and a
   host tier behind it, scores synthetic groups under the trainer's published weights:
   every ``logp_old`` must equal the trainer's own log-probs of the same records (through
   DeepSpeed, from the packed batch) bit for bit.
3. **A step.** ``consumers.step.StepRunner`` trains one step on those records: the loss is
   finite and the weights move.
4. **Version 1 and the host tier.** The trained weights, put in the store as version 1,
   push version 0 to the host tier. Version 1's ``logp_old`` equals the trainer's
   log-probs after the step, bit for bit; version 0, copied back from the host, scores
   exactly as before.

Reported with the old-logit service's tokens/s (its second pass over the records, store
look-ups included).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from consumers.batching import pack
from consumers.batching import response_logprobs as trainer_logprobs
from consumers.config import TrainerConfig
from consumers.step import StepRunner
from consumers.train_engine import TrainEngine
from core.devices import resolve_device
from core.models import load_model
from schemas.trajectory import Trajectory
from streams.config import OldLogitsConfig
from streams.oldlogits import OldLogitEngine
from streams.snapshots import InMemorySource, SnapshotStore
from tests.support.synthetic import synthetic_groups


@dataclass
class RolesReport:
    device: str
    model: str
    dtype: str
    records: int
    response_tokens: int
    v0_logp_old_equals_trainer: bool
    loss: float
    weights_moved: bool
    v1_logp_old_equals_trainer: bool
    v0_from_host_tier_unchanged: bool
    held_after_v1: dict[str, Any]
    oldlogit_tokens_per_s: float
    passed: bool


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_version(records: list[Trajectory], version: int) -> list[Trajectory]:
    """The same records, every segment generated under ``version``."""
    return [
        dataclasses.replace(t, segment_versions=np.full_like(t.segment_versions, version))
        for t in records
    ]


def _equals_trainer(found: list[Any], expected: torch.Tensor) -> bool:
    """Every record exact, its ``logp_old`` bitwise the trainer's row."""
    for row, result in enumerate(found):
        if result.status != "exact":
            return False
        width = len(result.logp_old)
        if not torch.equal(torch.from_numpy(result.logp_old), expected[row, :width]):
            return False
    return True


def check(
    device_name: str = "auto",
    spec: str = "tiny",
    dtype: str = "float32",
    groups: int = 4,
    prompt_len: int = 32,
    response_len: int = 96,
) -> RolesReport:
    """Run the four steps of the module doc; ``spec`` is a model spec (``tiny:...``)."""
    device = resolve_device(device_name)
    config = TrainerConfig.model_validate(
        {
            "model": spec,
            "engine": {"accelerator": device.type, "bf16": dtype == "bfloat16", "lr": 1e-3},
        }
    )
    engine = TrainEngine(load_model(config.model.spec, "float32"), config.engine)
    temperature = config.model.temperature
    vocab = int(engine.module.config.vocab_size)
    synthetic = synthetic_groups(
        groups, group_size=4, prompt_len=prompt_len, response_len=response_len, vocab_size=vocab
    )
    records = [t for group in synthetic for t in group]
    tokens = sum(t.num_response_tokens for t in records)

    def trainer_view(batch: list[Trajectory]) -> torch.Tensor:
        with torch.no_grad():
            return trainer_logprobs(engine.engine, pack(batch), temperature=temperature).cpu()

    v0 = {name: t.clone() for name, t in engine.state_dict().items()}  # what is published
    version_bytes = sum(t.numel() * t.element_size() for t in v0.values())
    store = SnapshotStore(
        InMemorySource({}),
        budget_bytes=int(1.5 * version_bytes),  # one version; a second evicts the first
        dtype=getattr(torch, dtype),
        device=device,
        host_budget_bytes=4 * version_bytes,
    )
    service = OldLogitEngine(
        OldLogitsConfig(model=spec, dtype=dtype, temperature=temperature, device=str(device)),
        store,
        device=device,
    )
    store.put(0, v0)
    expected_v0 = trainer_view(records)
    found_v0 = service.compute(records)  # loads the service's model, warms the kernels
    _synchronize(device)
    started = time.perf_counter()
    service.compute(records)
    _synchronize(device)
    oldlogit_s = time.perf_counter() - started
    v0_ok = _equals_trainer(found_v0, expected_v0)

    result = StepRunner(engine, config, pad_id=0).train_step([service.attach(records)])
    loss = float(result.metrics.get("loss/total", float("nan")))
    v1 = {name: t.clone() for name, t in engine.state_dict().items()}
    moved = any(not torch.equal(v0[name], v1[name]) for name in v0)

    store.put(1, v1)
    held = store.held()
    as_v1 = _as_version(records, 1)
    v1_ok = _equals_trainer(service.compute(as_v1), trainer_view(as_v1))
    again = service.compute(records)
    v0_again = all(
        a.status == "exact" and np.array_equal(a.logp_old, b.logp_old)
        for a, b in zip(again, found_v0, strict=True)
    )
    tier_ok = held.host_versions == (0,) and held.device_versions == (1,)
    passed = v0_ok and math.isfinite(loss) and moved and v1_ok and v0_again and tier_ok
    return RolesReport(
        device=str(device),
        model=spec,
        dtype=dtype,
        records=len(records),
        response_tokens=tokens,
        v0_logp_old_equals_trainer=v0_ok,
        loss=loss,
        weights_moved=moved,
        v1_logp_old_equals_trainer=v1_ok,
        v0_from_host_tier_unchanged=v0_again,
        held_after_v1=dataclasses.asdict(held),
        oldlogit_tokens_per_s=tokens / oldlogit_s,
        passed=passed,
    )
