"""What a test worker makes of the services xdist's controller hands it
(``support.shared_services``): nothing handed over means its own services, a description
gives the broker and each region with its credentials, garbage is refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from support.shared_services import WORKER_INPUT_KEY, SharedServices, shared_services

HANDED = SharedServices(
    bootstrap_servers="127.0.0.1:19092",
    regions={
        "region-a": {
            "name": "region-a",
            "endpoint_url": "http://127.0.0.1:18333",
            "access_key_id": "rollstream",
            "secret_access_key": "s3cret",
        }
    },
)


def _worker(**workerinput: str) -> pytest.Config:
    return SimpleNamespace(workerinput=workerinput)  # type: ignore[return-value]


def test_without_xdist_or_a_handout_the_worker_starts_its_own() -> None:
    assert shared_services(SimpleNamespace()) is None  # type: ignore[arg-type]
    assert shared_services(_worker(workerid="gw0")) is None


def test_a_handout_gives_the_broker_and_each_region_with_its_secret() -> None:
    got = shared_services(_worker(**{WORKER_INPUT_KEY: HANDED.model_dump_json()}))
    assert got is not None
    assert got.kafka().bootstrap_servers == "127.0.0.1:19092"
    region = got.s3("region-a")
    assert region.endpoint_url == "http://127.0.0.1:18333" and region.name == "region-a"
    assert region.secret_access_key is not None
    assert region.secret_access_key.get_secret_value() == "s3cret"


@pytest.mark.parametrize(
    "garbage",
    ["", "not json", "[]", '{"bootstrap_servers": 7}', '{"regions": {}}'],
)
def test_a_garbled_handout_is_refused_naming_what_is_wrong(garbage: str) -> None:
    with pytest.raises(ValidationError, match="SharedServices"):
        shared_services(_worker(**{WORKER_INPUT_KEY: garbage}))
