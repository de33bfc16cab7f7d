"""Helpers shared by the weight-plane tests: small states, sparse steps, chains, waiting."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from core.config import S3Config
from schemas.control import VersionAnnouncement
from weights import format as fmt
from weights.manifest import generate_keypair, load_private_key, parse_manifest
from weights.store import WeightStore
from weights.trust import Trust
from weights.writer import DeltaWriter

#: For tests that write unsigned versions on purpose (signing has tests of its own).
UNSIGNED = Trust(None)


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes and a tied pair, like a real checkpoint, but a few hundred KB."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    return {
        "embed.weight": embed,
        "head.weight": embed,  # tied
        "layers.0.attn.weight": torch.randn(48, 48, generator=gen).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(96, 48, generator=gen).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(48, dtype=torch.float32),
        "layers.0.scale": torch.randn(48, generator=gen).to(torch.float16),
    }


def step(
    state: dict[str, torch.Tensor], seed: int, fraction: float = 0.02
) -> dict[str, torch.Tensor]:
    """A new state with about ``fraction`` of each tensor's elements nudged (ties kept)."""
    gen = torch.Generator().manual_seed(seed)
    unique, aliases = fmt.split_aliases(state)
    out = {}
    for name, tensor in unique.items():
        noise = torch.randn(tensor.shape, generator=gen) * 0.05
        mask = torch.rand(tensor.shape, generator=gen) < fraction
        out[name] = torch.where(mask, (tensor.float() + noise).to(tensor.dtype), tensor)
    return fmt.join_aliases(out, aliases)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(fmt.bits(a[k]), fmt.bits(b[k]))
        for k in a
    )


def store_for(config: S3Config, run: str | None = None) -> WeightStore:
    return WeightStore.from_config(config, run or f"run-{uuid.uuid4().hex[:8]}")


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def keypair(directory: Path, name: str = "k") -> tuple[Path, Path]:
    private, public = directory / name, directory / f"{name}.pub"
    generate_keypair(private, public)
    return private, public


def forge(store: WeightStore, version: int, *, like: int, signer: Path | None = None) -> None:
    """Write, with the bucket's real credentials, a manifest for ``version`` copied from
    genuine ``like`` (its files exist): unsigned, or signed with a stranger's key."""
    manifest, _ = parse_manifest(store.read_manifest(like))
    forged = dataclasses.replace(manifest, version=version, signature=None)
    if forged.kind == "delta":
        forged = dataclasses.replace(forged, parent=like)
    else:
        forged = dataclasses.replace(forged, base=version)
    if signer is not None:
        forged = forged.sign(load_private_key(signer))
    for entry in manifest.files:
        store.client.copy_object(
            Bucket=store.bucket,
            Key=store.key(version, entry.name),
            CopySource={"Bucket": store.bucket, "Key": store.key(like, entry.name)},
        )
    store.claim(version, forged.to_bytes())


def forged_announcement(run: str, version: int) -> VersionAnnouncement:
    """An announcement of ``version`` that no store backs (an attacker's)."""
    return VersionAnnouncement(
        run=run,
        version=version,
        uri=f"s3://nowhere/weights/{run}/v{version:010d}/manifest.json",
        parent=None,
        base=version,
        sha256="0" * 64,
        bytes=1,
        published_at_ms=int(time.time() * 1000),
    )


def overwrite(store: WeightStore, key: str, body: bytes) -> None:
    """A plain (unconditional) put: what anyone with write access to the bucket can do."""
    store.client.put_object(Bucket=store.bucket, Key=key, Body=body)


def publish_chain(writer: DeltaWriter, count: int, seed: int = 0) -> list[dict]:
    states = [tiny_state(seed)]
    for i in range(1, count):
        states.append(step(states[-1], seed=1000 * seed + i))
    for state in states:
        writer.publish(state)
    return states
