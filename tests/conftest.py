"""Session-wide real services for the tests: one Kafka broker, two SeaweedFS "regions".

Each is started once per test session in a temporary directory (Kafka's jars come from
the cache under the user's home) and stopped at the end; under xdist, once for all the
workers. To reuse services that already run, set ``ROLLSTREAM_TEST_BOOTSTRAP``
(host:port) and/or ``ROLLSTREAM_TEST_S3_ENDPOINT`` (with ``AWS_ACCESS_KEY_ID``/
``AWS_SECRET_ACCESS_KEY`` for it). Tests get fresh buckets and uniquely named topics, so
they never see each other's data.

Tiers are folders, ``tests/{unit,integration,system}/<package>/test_<subject>.py``, and
markers (``support.tiers``): each test is marked at collection ``system`` (it or its module
says so: whole pipelines, chaos, kill -9), ``integration`` (a service fixture, or a module
that says so) or ``unit`` (no service), and a file sits in the folder of its slowest test;
collection fails on a test filed in a faster folder than its tier. ``pytest tests/unit``
runs the quick tier; ``pytest -m unit`` also picks the quick tests of slower files.

The suite runs in three worker processes (pytest-xdist, ``-n 3 --dist loadfile
--no-loadscope-reorder`` in ``pyproject.toml``), each taking a whole test file at a time,
so a module's shared pipeline run stays in one worker; the broker and the stores are
started once, by the process that starts the workers, and shared by them
(``support.shared_services``). Most tests spend their time waiting (on the broker, a
rebalance, a process starting), so three workers keep two cores busy. Files are handed
out in the order sorted here, slowest tier first (xdist's own reordering, by number of
tests, is off): the long system files start at once and the quick tiers fill the
workers' last minutes.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.paths import TESTS
from support.tiers import TIERS, folder_tier, marked_tier, misfiled

from core.config import KafkaConfig, S3Config, default_cache_dir
from infra.kafka import EmbeddedKafka
from infra.s3 import SeaweedServer, ensure_bucket
from weights.store import make_s3_client

if TYPE_CHECKING:
    from support.shared_services import SharedServices

# CPU seconds per test, printed with the durations; one broker and store for all workers
pytest_plugins = ("support.cpu_time", "support.shared_services")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, refuse a test filed in a faster folder than its tier,
    and hand out the folders slowest first (see the module doc)."""
    tiers = {item: marked_tier(item) for item in items}
    for item, tier in tiers.items():
        item.add_marker(tier)
    wrong = misfiled(((i.nodeid, i.path, t) for i, t in tiers.items()), TESTS)
    if wrong:
        raise pytest.UsageError("tests filed in the wrong tier folder:\n" + "\n".join(wrong))
    items.sort(key=lambda item: TIERS.index(folder_tier(item.path, TESTS) or "unit"))


def _shared_services(request: pytest.FixtureRequest) -> SharedServices | None:
    """The services xdist's controller started for every worker, if it did."""
    # imported once pytest_plugins loaded it (with its assertions rewritten), not before
    from support.shared_services import shared_services

    return shared_services(request.config)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The real cache under the user's home: Kafka jars are resolved once, not per run."""
    return default_cache_dir()


@pytest.fixture(scope="session")
def kafka_config(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[KafkaConfig]:
    """A ``KafkaConfig`` for a real Kafka 4.x broker (KRaft, single node)."""
    if servers := os.environ.get("ROLLSTREAM_TEST_BOOTSTRAP"):
        yield KafkaConfig(bootstrap_servers=servers)
        return
    if shared := _shared_services(request):
        yield shared.kafka()
        return
    broker = EmbeddedKafka(KafkaConfig(), tmp_path_factory.mktemp("kafka"), cache_dir)
    try:
        yield KafkaConfig(bootstrap_servers=broker.start())
    finally:
        broker.stop()


def _seaweed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str
) -> Iterator[S3Config]:
    if endpoint := os.environ.get("ROLLSTREAM_TEST_S3_ENDPOINT"):
        yield S3Config(name=name, endpoint_url=endpoint, embedded=False)
        return
    if shared := _shared_services(request):
        yield shared.s3(name)
        return
    server = SeaweedServer(tmp_path_factory.mktemp(name))
    try:
        server.start()
        yield server.config(name=name)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweed_region_a(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Config]:
    yield from _seaweed(request, tmp_path_factory, "region-a")


@pytest.fixture(scope="session")
def seaweed_region_b(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Config]:
    yield from _seaweed(request, tmp_path_factory, "region-b")


def _fresh_bucket(base: S3Config) -> S3Config:
    config = base.model_copy(update={"bucket": f"t-{uuid.uuid4().hex[:12]}"})
    ensure_bucket(make_s3_client(config), config.bucket)
    return config


@pytest.fixture()
def s3_config(seaweed_region_a: S3Config) -> S3Config:
    """A fresh, empty bucket on the real SeaweedFS server of region A."""
    return _fresh_bucket(seaweed_region_a)


@pytest.fixture(scope="module")
def module_s3_config(seaweed_region_a: S3Config) -> S3Config:
    """A fresh bucket on region A shared by one module's tests: for a pipeline run that
    several tests read (a module-scoped fixture)."""
    return _fresh_bucket(seaweed_region_a)


@pytest.fixture()
def second_s3_config(seaweed_region_b: S3Config) -> S3Config:
    """A fresh, empty bucket on a second, independent SeaweedFS server (region B)."""
    return _fresh_bucket(seaweed_region_b)


@pytest.fixture()
def unique_name() -> Callable[[str], str]:
    """Unique topic/bucket names per test: ``unique_name("rollouts.raw")``."""
    suffix = uuid.uuid4().hex[:8]
    return lambda base: f"{base}-{suffix}"
