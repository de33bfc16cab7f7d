"""``rollstream roles``: which role instances are in a run now, and each stream worker's lag.

Producers and stream workers join and leave a run from any machine, so the answer comes
from Kafka, not from a process list: the heartbeats on the presence topic
(``core.presence``) say who is there, who left cleanly (and what it did with its work in
flight), and who went silent (killed); the stream app's consumer group says which raw
partitions each stream worker holds and how many records of them are not yet processed
(``core.topic_reader.group_lag``). ``rollstream up``'s live display shows the same.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import click

from core.presence import Poller, Presence, read_presence
from core.topic_reader import MemberLag, group_lag
from rollstream.config.settings import RollstreamConfig
from schemas.control import ROLE_KINDS


@dataclass
class StreamWorkerLag:
    """One stream worker as the consumer group sees it."""

    instance: str  # its heartbeat instance, or the Kafka client id if it never beat
    partitions: tuple[int, ...]
    lag: int


@dataclass
class RunRoles:
    """Who is in a run now."""

    presence: Presence
    stream_lag: list[StreamWorkerLag] = field(default_factory=list)
    lag_error: str | None = None  # the group could not be described (broker busy)

    def count(self, role: str) -> int:
        return self.presence.count(role)

    def summary(self, role: str) -> str:
        """``2 active, 1 left, 1 silent`` for one kind of role."""
        parts = [f"{self.count(role)} active"]
        left = sum(b.role == role for b in self.presence.left)
        silent = sum(b.role == role for b in self.presence.silent)
        if left:
            parts.append(f"{left} left")
        if silent:
            parts.append(f"{silent} silent")
        return ", ".join(parts)

    def lag_line(self) -> str:
        """``host-12:3 [0,1,2,3]  host-13:0 [4,5,6,7]``: records behind per worker."""
        if self.lag_error is not None:
            return f"lag ? ({self.lag_error})"
        return "  ".join(
            f"{w.instance}:{w.lag} [{','.join(map(str, w.partitions))}]" for w in self.stream_lag
        )


def stream_worker_lag(members: list[MemberLag], app_id: str) -> list[StreamWorkerLag]:
    """Members of the stream app's group named by their instance (the client id is
    ``<app_id>-<instance>``, ``streams.faust.app``)."""
    prefix = f"{app_id}-"
    return [
        StreamWorkerLag(
            m.client_id[len(prefix) :] if m.client_id.startswith(prefix) else m.client_id,
            m.partitions,
            m.lag,
        )
        for m in members
        if m.partitions  # Faust's other topics' members hold no raw partition
    ]


def run_roles(config: RollstreamConfig) -> RunRoles:
    """Heartbeats and stream lag of ``config``'s run (its Kafka must be resolved)."""
    kafka = config.kafka.client_config()
    roles = RunRoles(read_presence(kafka, config.presence.topic, config.run_id))
    try:
        members = group_lag(kafka, config.streams.app_id, config.streams.topics.raw)
    except Exception as exc:  # a group mid-rebalance or a slow broker: say so, go on
        roles.lag_error = type(exc).__name__
    else:
        roles.stream_lag = stream_worker_lag(members, config.streams.app_id)
    return roles


def roles_poller(config: RollstreamConfig) -> Poller[RunRoles]:
    """``run_roles`` every heartbeat interval, off the caller's thread (``up``'s display)."""
    return Poller(lambda: run_roles(config), config.presence.interval_s).start()


@click.command("roles")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def roles_command(config: RollstreamConfig, as_json: bool) -> None:
    """Show the run's producers, stream workers and trainers (from their heartbeats) and
    each stream worker's lag on the raw topic."""
    from infra.services import Services

    resolved = Services(config).running(s3=False)
    views = (
        {name: resolved.view(name) for name in sorted(resolved.policies)}
        if resolved.policies and not resolved.policy
        else {resolved.policy: resolved}
    )  # a multi-policy run: each policy's roles heartbeat on its own topic
    found = {name: run_roles(view) for name, view in views.items()}
    if as_json:
        shown = {name: _as_json(views[name], roles) for name, roles in found.items()}
        click.echo(json.dumps(shown[resolved.policy] if len(views) == 1 else shown))
        return
    for name, roles in found.items():
        click.echo(f"run {resolved.run_id}" + (f", policy {name}" if name else ""))
        _print_roles(roles)


def _as_json(config: RollstreamConfig, roles: RunRoles) -> dict[str, object]:
    return {
        "run": config.run_id,
        "policy": config.policy,
        "active": [asdict(b) for b in roles.presence.active],
        "left": [asdict(b) for b in roles.presence.left],
        "silent": [asdict(b) for b in roles.presence.silent],
        "stream_lag": [asdict(w) for w in roles.stream_lag],
        "lag_error": roles.lag_error,
    }


def _print_roles(roles: RunRoles) -> None:
    now = time.time() * 1000
    for role in ROLE_KINDS:
        click.echo(f"{role:<9} {roles.summary(role)}")
        for state, beats in (
            ("active", roles.presence.active),
            ("left", roles.presence.left),
            ("silent", roles.presence.silent),
        ):
            for beat in (b for b in beats if b.role == role):
                seen = (now - beat.at_ms) / 1000
                detail = " ".join(f"{k}={v}" for k, v in beat.detail.items())
                click.echo(f"  {state:<7} {beat.instance} ({beat.host}, {seen:.0f}s ago) {detail}")
    click.echo(f"stream lag {roles.lag_line() or '-'}")
