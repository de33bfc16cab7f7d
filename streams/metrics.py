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

from prometheus_client import CollectorRegistry

from core.prometheus import MetricFactory, serve_registry


class StreamMetrics:
    """Every metric above; ``registry`` defaults to a fresh one (tests stay independent)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        m = MetricFactory(self.registry, "rollstream_streams_")
        self.records_in = m.counter("records_in", "Messages consumed.", ["topic"])
        self.records_out = m.counter("records_out", "Messages produced.", ["topic"])
        self.dlq = m.counter("dlq", "Records dead-lettered.", ["reason"])
        self.stale = m.counter("stale", "Records routed as stale.")
        self.filtered = m.counter(
            "filtered",
            "Samples a data operator filtered out (rollouts.filtered).",
            ["operator", "reason"],
        )
        self.operator_decisions = m.counter(
            "operator_decisions",
            "Groups each data operator kept, changed or filtered (decision = its reason).",
            ["operator", "decision"],
        )
        self.groups = m.counter("groups", "Groups closed.", ["outcome"])
        self.group_failures = m.counter("group_failures", "Groups whose closing raised.")
        self.processing_errors = m.counter(
            "processing_errors", "Messages whose processing raised.", ["topic"]
        )
        self.stale_at_close = m.counter("stale_at_close", "Samples stale when their group closed.")
        self.group_latency = m.histogram(
            "group_latency_seconds",
            "First sample seen to group emitted.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.oldlogit_tokens = m.counter("oldlogit_tokens", "Tokens given exact logp_old.")
        self.oldlogit_seconds = m.counter("oldlogit_seconds", "Forward-pass seconds for logp_old.")
        self.oldlogit_rate = m.gauge("oldlogit_tokens_per_second", "Tokens/s of the last batch.")
        self.oldlogit_status = m.counter(
            "oldlogit_status", "Samples by old_logits_status.", ["status"]
        )
        self.snapshot_hits = m.counter("snapshot_hits", "Snapshot hits.")
        self.snapshot_misses = m.counter("snapshot_misses", "Snapshot misses.")
        self.snapshot_rebuilds = m.counter("snapshot_rebuilds", "Versions rebuilt on a miss.")
        self.snapshot_unavailable = m.counter("snapshot_unavailable", "Versions the source lacked.")
        self.snapshot_evictions = m.counter("snapshot_evictions", "Versions evicted.")
        self.snapshot_bytes = m.gauge("snapshot_bytes", "Bytes held.")
        self.snapshot_versions = m.gauge("snapshot_versions", "Versions held.")
        self.snapshot_host_bytes = m.gauge("snapshot_host_bytes", "Bytes held in the host tier.")
        self.snapshot_host_versions = m.gauge(
            "snapshot_host_versions", "Versions held in the host tier."
        )
        self.snapshot_demotions = m.counter(
            "snapshot_demotions", "Versions moved from device to host."
        )
        self.snapshot_promotions = m.counter(
            "snapshot_promotions", "Versions copied back from host to device."
        )
        self.trainer_version = m.gauge("trainer_version", "Newest announced trainer version.")
        self.raw_partitions = m.gauge("raw_partitions", "Raw partitions this worker holds.")
        self.raw_lag = m.gauge("raw_lag", "Records of its raw partitions not committed yet.")

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample by its full name (``..._total`` for counters)."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose the registry over HTTP on ``host`` (loopback unless asked); returns the
        bound port."""
        return serve_registry(self.registry, port, host)
