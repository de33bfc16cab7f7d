"""The snapshot store's device and host tiers, and the old-logit device setting (CPU only:
the "device" tier is the CPU here; the store obeys its arguments, the config decides)."""

from __future__ import annotations

import pydantic
import pytest
import torch

from core.devices import check_device_name, resolve_device
from core.models import build_tiny_llama
from streams.config import OldLogitsConfig
from streams.snapshots import HeldSnapshots, InMemorySource, SnapshotStore, snapshot_store_for

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def states() -> dict[int, dict[str, torch.Tensor]]:
    return {v: build_tiny_llama(seed=200 + v).state_dict() for v in (1, 2, 3)}


def one_version(states) -> int:
    store = SnapshotStore(None, budget_bytes=1 << 30)
    store.put(1, states[1])
    return store.bytes


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cuda:-1", "", "CUDA", "cuda:", "cpu:0"])
def test_a_device_name_outside_the_grammar_is_refused(name: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="auto, cpu, cuda or cuda:N"):
        OldLogitsConfig(device=name)


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_in_the_grammar_are_accepted(name: str) -> None:
    assert OldLogitsConfig(device=name).device == check_device_name(name) == name


def test_auto_resolves_to_the_cpu_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda:0")


def test_an_evicted_version_waits_in_the_host_tier_and_comes_back(states) -> None:
    one = one_version(states)
    source = InMemorySource(states)
    store = SnapshotStore(source, budget_bytes=one, host_budget_bytes=10 * one)
    store.get(1)
    store.get(2)  # the device fits one version: 1 moves to the host tier
    assert store.held() == HeldSnapshots("cpu", (2,), one, (1,), one)
    assert 1 in store and store.versions == [2] and store.bytes == one
    got = store.get(1)  # promoted back, not rebuilt
    assert got is not None and same(got, states[1])
    assert source.loads == [1, 2]
    assert store.held() == HeldSnapshots("cpu", (1,), one, (2,), one)
    m = store.metrics
    assert m.value("rollstream_streams_snapshot_promotions_total") == 1
    assert m.value("rollstream_streams_snapshot_demotions_total") == 2
    assert m.value("rollstream_streams_snapshot_hits_total") == 1
    assert m.value("rollstream_streams_snapshot_misses_total") == 2
    assert m.value("rollstream_streams_snapshot_evictions_total") == 0
    assert m.value("rollstream_streams_snapshot_host_bytes") == one
    assert m.value("rollstream_streams_snapshot_host_versions") == 1
    assert m.value("rollstream_streams_snapshot_bytes") == one


def test_the_host_tier_is_lru_within_its_budget(states) -> None:
    one = one_version(states)
    source = InMemorySource(states)
    store = SnapshotStore(source, budget_bytes=one, host_budget_bytes=one)
    for version in (1, 2, 3):
        store.get(version)
    assert store.held() == HeldSnapshots("cpu", (3,), one, (2,), one)  # 1 dropped
    assert store.metrics.value("rollstream_streams_snapshot_evictions_total") == 1
    store.get(1)  # gone from both tiers: rebuilt
    assert source.loads == [1, 2, 3, 1]


def test_without_a_host_tier_an_evicted_version_is_rebuilt(states) -> None:
    one = one_version(states)
    source = InMemorySource(states)
    store = SnapshotStore(source, budget_bytes=one)
    store.get(1)
    store.get(2)
    assert store.held() == HeldSnapshots("cpu", (2,), one, (), 0) and 1 not in store
    got = store.get(1)
    assert got is not None and same(got, states[1])
    assert source.loads == [1, 2, 1]


def test_retain_drops_both_tiers(states) -> None:
    one = one_version(states)
    store = SnapshotStore(InMemorySource(states), budget_bytes=one, host_budget_bytes=10 * one)
    for version in (1, 2, 3):
        store.get(version)
    assert store.held().host_versions == (1, 2)
    assert store.retain(3) == [1, 2]
    assert store.held() == HeldSnapshots("cpu", (3,), one, (), 0)
    assert store.metrics.value("rollstream_streams_snapshot_host_versions") == 0


def test_a_pushed_version_leaves_the_host_tier(states) -> None:
    one = one_version(states)
    store = SnapshotStore(None, budget_bytes=one, host_budget_bytes=10 * one)
    store.put(1, states[1])
    store.put(2, states[2])
    store.put(1, states[1])  # pushed again: on the device, not also on the host
    assert store.held() == HeldSnapshots("cpu", (1,), one, (2,), one)


@pytest.mark.parametrize("overflow", ["rebuild", "host"])
def test_the_config_gives_a_host_tier_only_off_the_cpu(overflow: str) -> None:
    config = OldLogitsConfig(
        snapshot_memory_mb=2, snapshot_overflow=overflow, snapshot_host_memory_mb=3
    )
    on_cpu = snapshot_store_for(config, None, torch.device("cpu"))
    assert on_cpu.host_budget_bytes is None and on_cpu.budget_bytes == 2 << 20
    # Built for a GPU (nothing is allocated until a version is put).
    on_gpu = snapshot_store_for(config, None, torch.device("cuda:1"))
    assert on_gpu.device == torch.device("cuda:1") and on_gpu.held().device == "cuda:1"
    assert on_gpu.host_budget_bytes == (3 << 20 if overflow == "host" else None)
