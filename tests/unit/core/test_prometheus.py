"""The metric factory: names carry the prefix, metrics land on the caller's registry and
nowhere else, a name declared twice on one registry is refused, and the served registry
answers over HTTP on the port it reports."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from core.prometheus import MetricFactory, serve_registry

pytestmark = pytest.mark.unit


def test_each_kind_is_named_with_the_prefix_on_the_given_registry() -> None:
    registry = CollectorRegistry()
    m = MetricFactory(registry, "rollstream_test_")
    m.counter("events", "Events.", ["kind"]).labels(kind="a").inc(3)
    m.gauge("level", "Level.").set(7)
    m.summary("wait_seconds", "Waits.").observe(0.5)
    m.histogram("size", "Sizes.", buckets=(1, 10)).observe(4)

    value = registry.get_sample_value
    assert value("rollstream_test_events_total", {"kind": "a"}) == 3
    assert value("rollstream_test_level") == 7
    assert value("rollstream_test_wait_seconds_count") == 1
    assert value("rollstream_test_size_bucket", {"le": "1.0"}) == 0
    assert value("rollstream_test_size_bucket", {"le": "10.0"}) == 1
    assert REGISTRY.get_sample_value("rollstream_test_level") is None


def test_a_name_declared_twice_on_one_registry_is_refused() -> None:
    m = MetricFactory(CollectorRegistry(), "rollstream_test_")
    m.counter("events", "Events.")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        m.gauge("events_total", "Clashes with the counter's sample.")


def test_the_served_registry_answers_on_the_port_it_reports() -> None:
    registry = CollectorRegistry()
    MetricFactory(registry, "rollstream_test_").gauge("level", "Level.").set(2)
    port = serve_registry(registry, 0)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body = response.read().decode()
    assert "rollstream_test_level 2.0" in body
