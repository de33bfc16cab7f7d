"""The learning rig with a LoRA adapter: the adapter trains, the base stays, and every
role runs the trained version's weights (PEFT names hand off between them as they are)."""

from __future__ import annotations

import torch

import bench.learning
from bench.learning import ROUTES, Settings, run_cell
from bench.lora_learning import arms, version_cost
from core.config import LoraConfig
from core.models import is_adapter_tensor


def test_lora_cell_trains_only_the_adapter(monkeypatch) -> None:
    rigs = []
    build = bench.learning.build_rig

    def keep(*args, **kwargs):
        rigs.append(build(*args, **kwargs))
        return rigs[-1]

    monkeypatch.setattr(bench.learning, "build_rig", keep)
    lora = LoraConfig(rank=4)
    settings = Settings(steps=2, prompts_per_step=4, group_size=4, lr=3e-2, lora=lora)
    cell = run_cell(ROUTES[2], staleness=2, seed=0, settings=settings)
    assert len(cell.rewards) == 2
    rig = rigs[0]  # staleness 2 keeps version 0 in the history
    start, end = rig.history.load(0), rig.trainer.state_dict()
    changed = {name for name in start if not torch.equal(start[name], end[name].float())}
    assert changed and all(is_adapter_tensor(name) for name in changed)
    assert any(".lora_B." in name for name in changed)  # B moved off zero
    rig.generate_at(2)  # the engine loads the trained version, adapter and all
    generated = rig.generator.model.state_dict()
    assert all(torch.equal(generated[n], end[n].to(torch.bfloat16)) for n in changed)


def test_an_adapter_version_is_a_fraction_of_the_model() -> None:
    plan = arms([8], [1.0, 10.0], 3e-3)
    assert [a.lr for a in plan] == [3e-3, 3e-3, 3e-2] and plan[0].lora is None
    full, adapter = version_cost(None, "tiny"), version_cost(plan[1].lora, "tiny")
    assert adapter[0] < full[0] / 10 and adapter[1] < full[1] / 10
