"""One broker and two stores for a whole xdist session, shared by its workers.

Each worker used to start its own broker and stores: three JVMs, each warming up its
compiler and idling at about two CPU-seconds a minute here, and up to six SeaweedFS
servers, on two cores that the tests keep busy. The controller process (the one that
starts the workers) now starts one broker and one store per region before the workers
exist and hands their addresses and credentials to them in xdist's ``workerinput``; the
session fixtures of ``tests/conftest.py`` use them. Tests already name their topics,
groups, transactional ids and buckets uniquely, so sharing a broker across workers is
what sharing it within a worker was. Without xdist (``-n 0``) the fixtures start their
own, and ``ROLLSTREAM_TEST_BOOTSTRAP`` / ``ROLLSTREAM_TEST_S3_ENDPOINT`` still win.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from core.config import KafkaConfig, S3Config, default_cache_dir
from infra.kafka import EmbeddedKafka
from infra.s3 import SeaweedServer

WORKER_INPUT_KEY = "rollstream_shared_services"
REGIONS = ("region-a", "region-b")


class SharedServices(BaseModel):
    """What a worker needs to reach the controller's services: the broker's address and
    each region's endpoint with its credentials (the secret in clear: it goes from one
    test process to another through xdist's channel, never to a log)."""

    bootstrap_servers: str
    regions: dict[str, dict[str, Any]]  # each an ``S3Config``'s fields

    def kafka(self) -> KafkaConfig:
        return KafkaConfig(bootstrap_servers=self.bootstrap_servers)

    def s3(self, region: str) -> S3Config:
        return S3Config.model_validate(self.regions[region])


def shared_services(config: pytest.Config) -> SharedServices | None:
    """The controller's services, in a worker that was handed them; else None."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or WORKER_INPUT_KEY not in workerinput:
        return None
    return SharedServices.model_validate_json(workerinput[WORKER_INPUT_KEY])


class _Services:
    """The controller's broker and stores, started together, stopped at the end."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rollstream-test-services-"))
        self.broker = EmbeddedKafka(KafkaConfig(), self.root / "kafka", default_cache_dir())
        self.stores = {name: SeaweedServer(self.root / name) for name in REGIONS}

    def start(self) -> SharedServices:
        with ThreadPoolExecutor(len(self.stores) + 1) as pool:
            broker = pool.submit(self.broker.start)
            started = [pool.submit(store.start) for store in self.stores.values()]
            bootstrap = broker.result()
            for future in started:
                future.result()
        regions = {}
        for name, store in self.stores.items():
            s3 = store.config(name=name)  # what a worker's own store fixture gave
            secret = s3.secret_access_key.get_secret_value() if s3.secret_access_key else None
            regions[name] = {**s3.model_dump(mode="json"), "secret_access_key": secret}
        return SharedServices(bootstrap_servers=bootstrap, regions=regions)

    def stop(self) -> None:
        for store in self.stores.values():
            store.stop()
        self.broker.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class _Handout:
    """Puts the services' description into every worker's ``workerinput``."""

    def __init__(self, payload: str) -> None:
        self.payload = payload

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: object) -> None:
        node.workerinput[WORKER_INPUT_KEY] = self.payload  # type: ignore[attr-defined]


def _distributed_controller(config: pytest.Config) -> bool:
    if hasattr(config, "workerinput"):
        return False  # a worker
    return getattr(config.option, "dist", "no") != "no" and bool(
        getattr(config.option, "numprocesses", 0)
    )


def pytest_configure(config: pytest.Config) -> None:
    if not _distributed_controller(config):
        return
    if os.environ.get("ROLLSTREAM_TEST_BOOTSTRAP") or os.environ.get("ROLLSTREAM_TEST_S3_ENDPOINT"):
        return  # the user's own services: each fixture reads them itself
    services = _Services()
    config.add_cleanup(services.stop)
    described = services.start()
    config.pluginmanager.register(_Handout(described.model_dump_json()), "shared-services")
