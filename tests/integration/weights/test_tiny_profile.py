"""Why the tiny profile's versions are all bases, and that they become deltas, rebuilt bit
for bit, with the threshold the tiny profile sets (``[weights] max_delta_fraction = 1``).

Twenty AdamW steps (lr 3e-3, as the tiny profile) of the tiny model in fp32 change every
element every step, so a lossless delta is ~92% of a base: above the default 25%
threshold, every version is a base. With the threshold at 1 the same steps are published
as deltas (a base every ``base_every``), which a follower applies bit for bit."""

from __future__ import annotations

import torch
from support.weight_states import same_bits, store_for

from core.config import S3Config
from core.models import build_tiny_llama
from weights import format as fmt
from weights.follower import WeightFollower
from weights.manifest import Manifest
from weights.writer import DeltaWriter

STEPS = 20


def tiny_profile_states() -> list[dict[str, torch.Tensor]]:
    """The tiny model's weights before and after each of ``STEPS`` AdamW steps."""
    gen = torch.Generator().manual_seed(0)
    model = build_tiny_llama(seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for _ in range(STEPS):
        ids = torch.randint(5, 15, (32, 12), generator=gen)
        logits = model(ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(torch.randn(32, 1, generator=gen) * logp).mean()  # a policy-gradient loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def kinds(writer: DeltaWriter, states: list[dict[str, torch.Tensor]]) -> list[str]:
    return [writer.publish(state).manifest.kind for state in states]


def test_tiny_profile_steps_are_bases_by_default_and_deltas_at_threshold_one(
    s3_config: S3Config,
) -> None:
    states = tiny_profile_states()
    unique = [fmt.split_aliases(s)[0] for s in states]
    total = sum(t.numel() for t in unique[0].values())
    changed = [
        fmt.encode_delta(unique[i - 1], unique[i]).changed_elements for i in range(1, len(unique))
    ]
    assert min(changed) > 0.99 * total  # (nearly) every element, every step

    default = DeltaWriter(store_for(s3_config))  # max_delta_fraction 0.25
    assert kinds(default, states) == ["base"] * (STEPS + 1)

    store = store_for(s3_config)
    writer = DeltaWriter(store, max_delta_fraction=1.0, base_every=STEPS)
    assert kinds(writer, states) == ["base"] + ["delta"] * (STEPS - 1) + ["base"]
    sizes = [Manifest.from_bytes(store.read_manifest(v)).total_bytes for v in (0, 1)]
    assert sizes[1] < sizes[0]  # dense, yet still below a base

    cold = WeightFollower(store_for(s3_config, store.run))
    snapshot = cold.sync(STEPS - 1)  # from nothing: the base and 19 deltas
    assert snapshot is not None and same_bits(snapshot.state, states[STEPS - 1])
    follower = WeightFollower(store_for(s3_config, store.run))
    for version in range(STEPS + 1):  # one version at a time, as a running engine does
        snapshot = follower.sync(version)
        assert snapshot is not None and same_bits(snapshot.state, states[version])
