"""A producer and a stream worker join a running ``rollstream up`` run by hand, with the
run's config, then leave: one by SIGTERM, one by SIGKILL. Nothing is lost or trained
twice (the audit), the presence topic tells who is there, the joined producer starts at
the current version and says in its ledger what it did with its groups in flight.

The run ends as a user ends one: Ctrl-C on ``up`` (exit 130, no role left behind), then
the run's own config file brings the embedded services back and the audit reconciles,
what Ctrl-C cut short counted as in flight, not lost.

The scenario is ``bench.elastic`` (which prints the throughput of each phase), run short.
"""

from __future__ import annotations

import stat
import tomllib
from pathlib import Path

import pytest
from support.up_runs import strays

from bench.elastic import run_elastic
from core.process import pid_alive

pytestmark = pytest.mark.system


def _instances(roles: dict, state: str, role: str) -> list[str]:
    return sorted(b["instance"] for b in roles[state] if b["role"] == role)


def test_a_producer_and_a_stream_worker_join_and_leave_a_running_run(tmp_path: Path) -> None:
    report = run_elastic(tmp_path, phase_s=8.0, timeout_s=300.0)
    for phase in report.phases:
        print(phase)  # the figures, in the test's output

    # While joined: two producers and two stream workers in the run, each worker holding
    # raw partitions of its own, every partition held once.
    joined = report.roles_joined
    producer_id = f"{report.run_id}-producer-joined"
    assert producer_id in _instances(joined, "active", "producer")
    assert len(_instances(joined, "active", "producer")) == 2
    assert len(_instances(joined, "active", "streams")) == 2
    assert len(_instances(joined, "active", "trainer")) == 1
    held = [p for worker in joined["stream_lag"] for p in worker["partitions"]]
    assert len(joined["stream_lag"]) == 2 and sorted(held) == sorted(set(held))
    assert report.joined_raw_partitions >= 1  # its own Prometheus metric says so too

    # The joined producer loaded the current version before generating.
    assert report.joined_groups >= 1
    assert report.joined_first_version is not None
    assert report.joined_first_version >= report.version_at_join

    # SIGTERM: it left, saying what became of its groups in flight (abort by default).
    stop = report.joined_stop
    assert stop["policy"] == "abort" and stop["unacknowledged"] == []
    after = report.roles_after
    assert producer_id in _instances(after, "left", "producer")
    left = next(b for b in after["left"] if b["instance"] == producer_id)
    assert left["detail"]["aborted"] == len(stop["aborted"])
    # SIGKILL: the stream worker never said goodbye; it went silent, its partitions
    # went back to the first worker. (The first worker may itself have been restarted by
    # its supervisor meanwhile, a step fenced by the rebalance: its old instance is then
    # silent too.)
    before = set(_instances(report.roles_before, "active", "streams"))
    killed = set(_instances(joined, "active", "streams")) - before
    assert len(killed) == 1
    assert killed <= set(_instances(after, "silent", "streams"))
    assert len(_instances(after, "active", "streams")) == 1
    assert len(after["stream_lag"]) == 1

    # The run went on through both and the audit holds.
    # (run_elastic waits, within its timeout, for a trainer step after the join and after
    # the leave before it measures; a phase's own figures are printed, not asserted: a
    # fixed window can fall inside a rebalance pause.)
    assert report.phases[0].steps_per_s > 0
    audit = report.audit
    assert audit["problems"] == [] and audit["missing"] == 0
    assert audit["trained_twice"] == 0 and audit["trained"] > 0
    # the producers ran ahead of the last step: those records are in flight, not lost
    in_flight = audit["untrained"] + audit["unprocessed"]
    assert audit["delivered"] == (
        audit["trained_of_delivered"]
        + audit["stale_of_delivered"]
        + audit["dlq_of_delivered"]
        + in_flight
    )

    # Ctrl-C: up exited 130 and left no role behind.
    assert report.up_exit == 130
    assert len(report.role_pids) == 4
    assert not [name for name, pid in report.role_pids.items() if pid_alive(pid)]
    assert not strays(report.run_dir)
    # The run's file: private (it can hold credentials), and embedded stays embedded, so
    # `infra up` from it started the run's own services again, quickly and cleanly.
    config = report.run_dir / "rollstream.toml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    written = tomllib.loads(config.read_text())
    assert not written["kafka"].get("bootstrap_servers")
    assert not written["s3"].get("endpoint_url") and not written["s3"].get("secret_access_key")
    assert report.infra_up_s < 60 and "Traceback" not in report.infra_up_stderr
