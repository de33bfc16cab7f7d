"""Declaring Prometheus metrics on a registry the caller owns, and serving it.

Every role keeps its metrics on its own ``CollectorRegistry`` (no global registry: two
workers in one process never collide). Where a class declares a long list of them under
one name prefix (the producer's, the stream's, the weight follower's), ``MetricFactory``
holds the registry and the prefix, so each declaration says only what is its own: name,
help and labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    start_http_server,
)


@dataclass(frozen=True)
class MetricFactory:
    """Makes metrics named ``prefix + name`` on ``registry``."""

    registry: CollectorRegistry
    prefix: str = ""

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.prefix + name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.prefix + name, documentation, labels, registry=self.registry)

    def summary(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Summary:
        return Summary(self.prefix + name, documentation, labels, registry=self.registry)

    def histogram(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labels: Sequence[str] = (),
    ) -> Histogram:
        return Histogram(
            self.prefix + name, documentation, labels, registry=self.registry, buckets=buckets
        )


def serve_registry(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Expose ``registry`` over HTTP on ``host`` (loopback unless asked); returns the bound
    port (``port`` 0 picks a free one)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
