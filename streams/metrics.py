"""Prometheus metrics of a stream worker, on a registry the caller owns (or a new one).

=================================================  ==========================================
metric                                             meaning
=================================================  ==========================================
``rollstream_streams_records_in_total{topic}``     messages consumed (raw records and ticks)
``rollstream_streams_records_out_total{topic}``    messages produced to scored / stale / dlq
``rollstream_streams_dlq_total{reason}``           records dead-lettered, by reason code
``rollstream_streams_stale_total``                 records routed to the stale topic
``rollstream_streams_groups_total{outcome}``       groups closed: complete / partial / dropped
                                                   / failed
``rollstream_streams_group_failures_total``        groups whose closing raised (every sample
                                                   dead-lettered as ``group_failed``)
``rollstream_streams_processing_errors_total{t}``  messages whose processing raised
``rollstream_streams_stale_at_close_total``        samples admitted on arrival that were stale
                                                   when their group closed
``rollstream_streams_group_latency_seconds``       first sample seen → group emitted (histogram)
``rollstream_streams_oldlogit_tokens_total``       response tokens given exact ``logp_old``
``rollstream_streams_oldlogit_seconds_total``      forward-pass seconds spent on them; the
                                                   ratio of the two rates is tokens/s
``rollstream_streams_oldlogit_tokens_per_second``  tokens/s of the last old-logit batch
``rollstream_streams_oldlogit_status_total{s}``    samples by ``old_logits_status``
``rollstream_streams_snapshot_hits_total``         snapshot lookups served from memory (either
                                                   tier)
``rollstream_streams_snapshot_misses_total``       lookups that had to rebuild (or failed)
``rollstream_streams_snapshot_rebuilds_total``     versions rebuilt from the source on a miss
``rollstream_streams_snapshot_unavailable_total``  versions the source could not provide
``rollstream_streams_snapshot_evictions_total``    versions evicted (LRU over budget, window)
``rollstream_streams_snapshot_bytes``              bytes of weights held on the compute device
                                                   (shared tensors once)
``rollstream_streams_snapshot_versions``           versions held on the compute device
``rollstream_streams_snapshot_host_bytes``         bytes held in the host tier (versions the
                                                   device budget evicted; overflow ``host``)
``rollstream_streams_snapshot_host_versions``      versions held in the host tier
``rollstream_streams_snapshot_demotions_total``    versions moved from the device to the host
``rollstream_streams_snapshot_promotions_total``   versions copied back from the host on use
``rollstream_streams_trainer_version``             newest announced trainer version
``rollstream_streams_raw_partitions``              raw partitions this worker holds now
``rollstream_streams_raw_lag``                     records of them its group has not
                                                   committed yet (its lag)
=================================================  ==========================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PREFIX = "rollstream_streams_"


class StreamMetrics:
    """Every metric above; ``registry`` defaults to a fresh one (tests stay independent)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.records_in = Counter(
            _PREFIX + "records_in", "Messages consumed.", ["topic"], registry=r
        )
        self.records_out = Counter(
            _PREFIX + "records_out", "Messages produced.", ["topic"], registry=r
        )
        self.dlq = Counter(_PREFIX + "dlq", "Records dead-lettered.", ["reason"], registry=r)
        self.stale = Counter(_PREFIX + "stale", "Records routed as stale.", registry=r)
        self.filtered = Counter(
            _PREFIX + "filtered",
            "Samples a data operator filtered out (rollouts.filtered).",
            ["operator", "reason"],
            registry=r,
        )
        self.operator_decisions = Counter(
            _PREFIX + "operator_decisions",
            "Groups each data operator kept, changed or filtered (decision = its reason).",
            ["operator", "decision"],
            registry=r,
        )
        self.groups = Counter(_PREFIX + "groups", "Groups closed.", ["outcome"], registry=r)
        self.group_failures = Counter(
            _PREFIX + "group_failures", "Groups whose closing raised.", registry=r
        )
        self.processing_errors = Counter(
            _PREFIX + "processing_errors",
            "Messages whose processing raised.",
            ["topic"],
            registry=r,
        )
        self.stale_at_close = Counter(
            _PREFIX + "stale_at_close", "Samples stale when their group closed.", registry=r
        )
        self.group_latency = Histogram(
            _PREFIX + "group_latency_seconds",
            "First sample seen to group emitted.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.oldlogit_tokens = Counter(
            _PREFIX + "oldlogit_tokens", "Tokens given exact logp_old.", registry=r
        )
        self.oldlogit_seconds = Counter(
            _PREFIX + "oldlogit_seconds", "Forward-pass seconds for logp_old.", registry=r
        )
        self.oldlogit_rate = Gauge(
            _PREFIX + "oldlogit_tokens_per_second", "Tokens/s of the last batch.", registry=r
        )
        self.oldlogit_status = Counter(
            _PREFIX + "oldlogit_status", "Samples by old_logits_status.", ["status"], registry=r
        )
        self.snapshot_hits = Counter(_PREFIX + "snapshot_hits", "Snapshot hits.", registry=r)
        self.snapshot_misses = Counter(_PREFIX + "snapshot_misses", "Snapshot misses.", registry=r)
        self.snapshot_rebuilds = Counter(
            _PREFIX + "snapshot_rebuilds", "Versions rebuilt on a miss.", registry=r
        )
        self.snapshot_unavailable = Counter(
            _PREFIX + "snapshot_unavailable", "Versions the source lacked.", registry=r
        )
        self.snapshot_evictions = Counter(
            _PREFIX + "snapshot_evictions", "Versions evicted.", registry=r
        )
        self.snapshot_bytes = Gauge(_PREFIX + "snapshot_bytes", "Bytes held.", registry=r)
        self.snapshot_versions = Gauge(_PREFIX + "snapshot_versions", "Versions held.", registry=r)
        self.snapshot_host_bytes = Gauge(
            _PREFIX + "snapshot_host_bytes", "Bytes held in the host tier.", registry=r
        )
        self.snapshot_host_versions = Gauge(
            _PREFIX + "snapshot_host_versions", "Versions held in the host tier.", registry=r
        )
        self.snapshot_demotions = Counter(
            _PREFIX + "snapshot_demotions", "Versions moved from device to host.", registry=r
        )
        self.snapshot_promotions = Counter(
            _PREFIX + "snapshot_promotions", "Versions copied back from host to device.", registry=r
        )
        self.trainer_version = Gauge(
            _PREFIX + "trainer_version", "Newest announced trainer version.", registry=r
        )
        self.raw_partitions = Gauge(
            _PREFIX + "raw_partitions", "Raw partitions this worker holds.", registry=r
        )
        self.raw_lag = Gauge(
            _PREFIX + "raw_lag", "Records of its raw partitions not committed yet.", registry=r
        )

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample by its full name (``..._total`` for counters)."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose the registry over HTTP on ``host`` (loopback unless asked); returns the
        bound port."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
