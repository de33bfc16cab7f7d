"""The rollout worker's metrics (Prometheus, own registry) and its terminal progress line.

Metrics, all prefixed ``rollstream_producer_``:

- ``tokens_total`` (counter): response tokens generated, interrupted attempts included.
  tokens/s is ``rate(...)`` of it.
- ``groups_total`` (counter): groups whose G records were all acknowledged by Kafka.
  groups/s is its rate.
- ``trajectories_total`` (counter): records acknowledged.
- ``version`` (gauge): policy version the engine currently serves.
- ``latest_version`` (gauge): newest version announced to the worker.
- ``version_lag`` (gauge): ``latest_version - version`` (weights still to be applied).
- ``lead`` (gauge): trainer steps of groups this worker started beyond the trainer's
  trained version (its credit; admission pauses once it reaches the staleness window
  + 1). A stopped trainer shows here: the lead climbs to the window and stays.
- ``consumed_lag`` (gauge): ``version - trainer consumed version`` (with a
  ``consumed_version`` hook only).
- ``admission_paused`` (gauge): 1 while no new group may start.
- ``inflight_groups`` / ``undelivered_groups`` (gauges): generating / awaiting acks.
- ``interrupted_samples_total`` (counter, label ``policy``): samples cut by a version
  change (continued for ``interrupt``, regenerated for ``abort``).
- ``gateway_calls_total`` (counter, labels ``endpoint``, ``status``),
  ``gateway_history_mismatches_total`` (label ``action``), ``gateway_abandoned_total``
  (label ``reason``), ``gateway_retries_total`` (label ``outcome``): the gateway's calls,
  its episodes whose history was not a continuation, its episodes never published, and the
  retried calls answered with their first turn.
- ``delivery_failures_total`` (counter): records Kafka refused or timed out.
- ``engine_errors_total`` (counter): engine calls that failed after retries.
- ``publish_seconds`` / ``generate_seconds`` (summaries): per group, the time from
  encoding to handing the records to the producer (the ledger fsync wait included), and
  the generation time.

No global registry: each worker owns a ``CollectorRegistry`` (``metrics.registry``), so
two workers in one process never collide; ``serve(port)`` exposes it over HTTP.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from prometheus_client import CollectorRegistry

from core.prometheus import MetricFactory, serve_registry

logger = logging.getLogger(__name__)


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        m = MetricFactory(self.registry, "rollstream_producer_")
        self.tokens = m.counter("tokens", "Response tokens generated.")
        self.groups = m.counter("groups", "Groups delivered (all G acknowledged).")
        self.trajectories = m.counter("trajectories", "Records acknowledged.")
        self.version = m.gauge("version", "Policy version the engine serves.")
        self.latest_version = m.gauge("latest_version", "Newest version announced.")
        self.version_lag = m.gauge("version_lag", "latest_version - version.")
        self.lead = m.gauge(
            "lead", "Trainer steps of groups started beyond the trainer's trained version."
        )
        self.consumed_lag = m.gauge("consumed_lag", "version - trainer consumed version.")
        self.admission_paused = m.gauge("admission_paused", "1 while no new group may start.")
        self.inflight_groups = m.gauge("inflight_groups", "Groups generating.")
        self.undelivered_groups = m.gauge("undelivered_groups", "Groups produced, awaiting acks.")
        self.interrupted = m.counter(
            "interrupted_samples", "Samples cut by a version change.", ["policy"]
        )
        self.delivery_failures = m.counter(
            "delivery_failures", "Records Kafka refused or timed out."
        )
        self.curriculum_skipped = m.counter(
            "curriculum_skipped",
            "Prompts the curriculum skipped (reason: solved | hopeless).",
            ["reason"],
        )
        self.episodes = m.counter(
            "episodes",
            "Multi-turn episodes published, by why they ended (done, max_turns, a tool "
            "failure, ...).",
            ["end"],
        )
        self.tool_calls = m.counter(
            "tool_calls", "Tool calls made by the policy in published episodes."
        )
        self.reward_errors = m.counter(
            "reward_errors",
            "Completions a reward function gave no value for: it raised, timed out or "
            "returned something that is not a finite number per completion.",
            ["function"],
        )
        self.peer_samples = m.counter(
            "peer_samples",
            "Turns of peer policies published as their policy's records, by policy.",
            ["policy"],
        )
        self.peer_samples_dropped = m.counter(
            "peer_samples_dropped",
            "Turns of peer policies not published, by policy: their group had fewer than 2 "
            "samples, or the sample named a policy that is not a peer ('unknown').",
            ["policy"],
        )
        self.gateway_calls = m.counter(
            "gateway_calls",
            "Gateway API calls, by endpoint and HTTP status.",
            ["endpoint", "status"],
        )
        self.gateway_mismatches = m.counter(
            "gateway_history_mismatches",
            "Gateway calls whose history did not extend their episode's tokens, by what "
            "was done (split: a new record of the episode; refuse: answered 409).",
            ["action"],
        )
        self.gateway_abandoned = m.counter(
            "gateway_abandoned",
            "Gateway episodes ended without a reward, never published (reason: idle, "
            "unclaimed, client_left, no_call, stopped).",
            ["reason"],
        )
        self.gateway_retries = m.counter(
            "gateway_retries",
            "Gateway calls that retried their episode's last call, answered with its turn "
            "instead of a second one (outcome: answered_again, delivered_late, failure).",
            ["outcome"],
        )
        self.engine_errors = m.counter("engine_errors", "Engine calls failed after retries.")
        self.publish_seconds = m.summary("publish_seconds", "Serialise + produce time per group.")
        self.generate_seconds = m.summary("generate_seconds", "Generation time per group.")

    def get(self, sample: str) -> float:
        """Current value of a sample, e.g. ``get("groups_total")`` or ``get("version")``."""
        return self.registry.get_sample_value("rollstream_producer_" + sample) or 0.0

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose the registry over HTTP on ``addr`` (loopback unless asked)."""
        serve_registry(self.registry, port, addr)


class Progress:
    """A one-line status: a live ``rich`` line on a terminal, a log line every 30 s else."""

    def __init__(self, metrics: ProducerMetrics, *, enabled: bool = True, total: int | None = None):
        self.metrics = metrics
        self.total = total
        self._live: Any = None
        self._last = (time.monotonic(), 0.0, 0.0)
        self._rates = (0.0, 0.0)
        self._last_log = 0.0
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
            self._live.start()

    def line(self) -> str:
        m = self.metrics
        now = time.monotonic()
        tokens, groups = m.get("tokens_total"), m.get("groups_total")
        then, tokens0, groups0 = self._last
        if now - then >= 1.0:
            self._rates = ((tokens - tokens0) / (now - then), (groups - groups0) / (now - then))
            self._last = (now, tokens, groups)
        done = f"{int(groups)}" + (f"/{self.total}" if self.total is not None else "")
        paused = " [admission paused]" if m.get("admission_paused") else ""
        return (
            f"groups {done}  {self._rates[1]:.2f} groups/s  {self._rates[0]:.0f} tok/s  "
            f"v{int(m.get('version'))} (lag {int(m.get('version_lag'))}, "
            f"ahead of trainer {m.get('lead'):.1f} steps)  "
            f"inflight {int(m.get('inflight_groups'))}  "
            f"unacked {int(m.get('undelivered_groups'))}  "
            f"delivery failures {int(m.get('delivery_failures_total'))}{paused}"
        )

    def update(self) -> None:
        text = self.line()
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(text))
        elif time.monotonic() - self._last_log >= 30.0:
            self._last_log = time.monotonic()
            logger.info("%s", text)

    def close(self) -> None:
        if self._live is not None:
            self.update()
            self._live.stop()
            self._live = None
