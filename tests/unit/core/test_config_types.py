"""The shared field types keep every section's bounds: a duration of 0 or less, a port out
of range and a host that is not a string are refused wherever the field is declared, and
the defaults stay what they were."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from consumers.config import TrainerConfig
from core.config import RestartConfig, RetryConfig, WeightsConfig
from producers.config import EpisodeConfig, GatewayConfig, RolloutConfig
from streams.config import GroupsConfig, StreamsConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("section", "field", "default"),
    [
        (RolloutConfig, "connect_timeout_s", 5.0),
        (RolloutConfig, "request_timeout_s", 600.0),
        (GatewayConfig, "idle_timeout_s", 120.0),
        (GroupsConfig, "timeout_s", 120.0),
        (StreamsConfig, "session_timeout_s", 60.0),
        (RetryConfig, "initial_s", 0.5),
        (RestartConfig, "window_s", 300.0),
        (WeightsConfig, "poll_interval_s", 2.0),
        (EpisodeConfig, "tool_timeout_s", None),
    ],
)
def test_durations_must_be_more_than_zero(
    section: type[BaseModel], field: str, default: float | None
) -> None:
    assert section.model_fields[field].default == default
    for bad in (0, -1.0, float("inf"), "soon"):
        with pytest.raises(ValidationError, match=field):
            section(**{field: bad})
    assert getattr(section(**{field: 0.25}), field) == 0.25


@pytest.mark.parametrize(
    ("section", "field", "default"),
    [
        (RolloutConfig, "metrics_port", None),
        (StreamsConfig, "metrics_port", None),
        (TrainerConfig, "prometheus_port", None),
        (GatewayConfig, "port", 8100),
    ],
)
def test_ports_are_0_to_65535(section: type[BaseModel], field: str, default: int | None) -> None:
    assert section.model_fields[field].default == default
    for bad in (-1, 65536, "http"):
        with pytest.raises(ValidationError, match=field):
            section(**{field: bad})
    assert getattr(section(**{field: 0}), field) == 0


@pytest.mark.parametrize(
    ("section", "field"),
    [
        (RolloutConfig, "metrics_host"),
        (StreamsConfig, "metrics_host"),
        (TrainerConfig, "prometheus_host"),
    ],
)
def test_metrics_hosts_default_to_loopback_and_take_only_strings(
    section: type[BaseModel], field: str
) -> None:
    info = section.model_fields[field]
    assert info.default == "127.0.0.1"
    assert info.description is not None and "open it on purpose" in info.description
    bad: Any
    for bad in (3, None, ["0.0.0.0"]):
        with pytest.raises(ValidationError, match=field):
            section(**{field: bad})
