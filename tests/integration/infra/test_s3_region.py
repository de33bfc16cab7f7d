"""A bucket outside us-east-1: created with the region as its location constraint, as
AWS requires, on the real SeaweedFS store."""

from __future__ import annotations

import uuid
from typing import Any

from core.config import S3Config
from infra.s3 import ensure_bucket
from weights.store import make_s3_client


def _created_with(config: S3Config) -> tuple[bool, list[bytes]]:
    """Create ``config.bucket``; returns whether it was created and each CreateBucket
    request's body as sent."""
    client = make_s3_client(config)
    bodies: list[bytes] = []

    def capture(request: Any, **_: Any) -> None:
        bodies.append(request.body or b"")

    client.meta.events.register("before-send.s3.CreateBucket", capture)
    created = ensure_bucket(client, config.bucket)
    client.head_bucket(Bucket=config.bucket)  # it exists
    return created, bodies


def test_a_bucket_outside_us_east_1_names_its_region(s3_config: S3Config) -> None:
    config = s3_config.model_copy(
        update={"region_name": "eu-west-1", "bucket": f"t-eu-{uuid.uuid4().hex[:10]}"}
    )
    created, bodies = _created_with(config)
    assert created and len(bodies) == 1
    assert b"<LocationConstraint>eu-west-1</LocationConstraint>" in bodies[0]
    assert _created_with(config) == (False, [])  # there already: nothing sent


def test_a_us_east_1_bucket_sends_no_constraint(s3_config: S3Config) -> None:
    config = s3_config.model_copy(update={"bucket": f"t-us-{uuid.uuid4().hex[:10]}"})
    assert config.region_name == "us-east-1"
    created, bodies = _created_with(config)
    assert created and bodies == [b""]
