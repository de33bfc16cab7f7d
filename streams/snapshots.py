"""The snapshot store: in-memory weights of recent policy versions, for exact old logits.

Seed 000's first exact repair ("snapshot-based version tracking"): keep θ_v for every
version still inside the staleness window. Versions arrive two ways:

- **pushed** by a ``WeightFollower`` callback (``FollowerFeed``) as the trainer publishes
  them, so the common case (a recent version) is a hit;
- **pulled** on a miss: ``get(v)`` asks its ``SnapshotSource`` to rebuild ``v`` (from the
  base and deltas in S3 for ``FollowerSource``). A version that cannot be rebuilt is
  reported unavailable (``None``), never guessed or replaced by a neighbour.

Memory: the store holds versions on its ``device`` (where the old-logit pass runs), at
most ``budget_bytes`` of them (tensors shared between versions, as the follower's
delta-rebuilt states share untouched tensors, count once); beyond it the least recently
used versions are evicted. The version being returned is never evicted, so a single
version larger than the budget still works. An evicted version is dropped (rebuilt on its
next miss) or, with ``host_budget_bytes``, moved to a host-memory tier, LRU within that
budget, and copied back to the device on use: a GPU's memory holds a few versions, the
host many more, and a copy back is far cheaper than a rebuild from S3. ``retain(oldest)``
drops versions that left the staleness window from both tiers.

Thread safety: ``put`` (follower thread), ``get`` (old-logit executor) and ``retain`` (event
loop) may run concurrently; one rebuild runs at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from core.models import ModelSpec, build_tiny_llama, parse_model_spec
from streams.config import OldLogitsConfig
from streams.metrics import StreamMetrics

if TYPE_CHECKING:
    import torch

    from weights.follower import Snapshot
    from weights.store import WeightStore

log = logging.getLogger(__name__)

StateDict = Mapping[str, "torch.Tensor"]

MIB = 1024 * 1024


class VersionUnavailable(LookupError):
    """A source cannot provide a version (never published, deleted, or refused)."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(version, reason)
        self.version = version
        self.reason = reason

    def __str__(self) -> str:
        return f"version {self.version} unavailable: {self.reason}"


class SnapshotSource(Protocol):
    """Rebuilds the weights of one version on demand."""

    def load(self, version: int) -> StateDict:
        """The state dict of ``version``; raises ``VersionUnavailable``."""
        ...


class InMemorySource:
    """Versions held in a dict (tests); a version not in it is unavailable."""

    def __init__(self, states: Mapping[int, StateDict] | None = None) -> None:
        self.states: dict[int, StateDict] = dict(states or {})
        self.loads: list[int] = []

    def load(self, version: int) -> StateDict:
        self.loads.append(version)
        if version not in self.states:
            raise VersionUnavailable(version, "not in the in-memory source")
        return self.states[version]


class SeededSource:
    """Version ``v`` is the tiny model of ``spec`` (a ``core.models`` model spec) initialised
    with seed ``spec seed + seed_base + v``: with ``seed_base`` 0, version 0 is the spec's
    own model, the trainer's initial weights.

    For benchmarks and tests that need many distinct versions without a trainer; every
    version exists. Not for training runs.
    """

    def __init__(self, spec: str | ModelSpec = "tiny", seed_base: int = 0) -> None:
        parsed = parse_model_spec(spec)
        if not parsed.is_tiny:
            raise ValueError(f"the seeded source builds tiny models only, not {parsed.name!r}")
        self.model_kwargs = parsed.tiny_kwargs
        self.seed_base = seed_base + self.model_kwargs.pop("seed", 0)

    def load(self, version: int) -> StateDict:
        if version < 0:
            raise VersionUnavailable(version, "negative version")
        return build_tiny_llama(seed=self.seed_base + version, **self.model_kwargs).state_dict()


class FollowerSource:
    """Rebuilds any version from a region's store with a fresh ``WeightFollower``: the
    version's base, then its deltas, each file's sha256 and the final state digest checked
    (``weights``). Refusals (missing, corrupt, deleted by retention) and S3
    errors that persist over ``max_attempts`` tries become ``VersionUnavailable``."""

    def __init__(
        self,
        store: WeightStore,
        *,
        make_follower: Callable[[WeightStore], Any] | None = None,
        max_attempts: int = 3,
        timeout_s: float = 60.0,
    ) -> None:
        self.store = store
        self.make_follower = make_follower
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s

    def load(self, version: int) -> StateDict:
        from botocore.exceptions import BotoCoreError, ClientError

        from weights.errors import WeightsError
        from weights.follower import WeightFollower

        follower = (
            self.make_follower(self.store) if self.make_follower else WeightFollower(self.store)
        )
        try:
            snapshot = follower.sync_with_retry(
                version, max_attempts=self.max_attempts, give_up_after_s=self.timeout_s
            )
        except (WeightsError, BotoCoreError, ClientError) as err:
            raise VersionUnavailable(version, f"{type(err).__name__}: {err}") from err
        if snapshot is None or snapshot.version != version:
            raise VersionUnavailable(version, "the store does not hold it")
        return snapshot.state


@dataclasses.dataclass(frozen=True, slots=True)
class HeldSnapshots:
    """What a ``SnapshotStore`` holds, per tier (versions least recently used first)."""

    device: str
    device_versions: tuple[int, ...]
    device_bytes: int
    host_versions: tuple[int, ...] = ()
    host_bytes: int = 0


class SnapshotStore:
    """Weights of recent versions in ``dtype`` on ``device``, LRU within ``budget_bytes``;
    with ``host_budget_bytes``, what the device evicts waits in host memory, LRU within
    that budget, and is copied back on use."""

    def __init__(
        self,
        source: SnapshotSource | None,
        *,
        budget_bytes: int,
        dtype: torch.dtype | None = None,
        metrics: StreamMetrics | None = None,
        device: torch.device | str | None = None,
        host_budget_bytes: int | None = None,
    ) -> None:
        import torch

        self.source = source
        self.budget_bytes = int(budget_bytes)
        self.dtype = dtype
        self.device = torch.device("cpu" if device is None else device)
        self.host_budget_bytes = None if host_budget_bytes is None else int(host_budget_bytes)
        self.metrics = metrics if metrics is not None else StreamMetrics()
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._host: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._host_bytes = 0
        self._oldest = 0  # retain's floor: a version copied to the host below it is dropped
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

    # --- reading --------------------------------------------------------------------------

    @property
    def versions(self) -> list[int]:
        """Versions held on the device, least recently used first."""
        with self._lock:
            return list(self._states)

    @property
    def bytes(self) -> int:
        """Bytes held on the device."""
        return self._bytes

    def held(self) -> HeldSnapshots:
        """Versions and bytes of each tier, as one consistent reading."""
        with self._lock:
            return HeldSnapshots(
                str(self.device),
                tuple(self._states),
                self._bytes,
                tuple(self._host),
                self._host_bytes,
            )

    def __contains__(self, version: int) -> bool:
        """Held in either tier (served without the source)."""
        with self._lock:
            return version in self._states or version in self._host

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of ``version`` on the device: held, copied back from the host tier,
        or rebuilt from the source on a miss; ``None`` if the source cannot provide it."""
        with self._lock:
            state = self._touch(version)
            parked = version in self._host
        if state is not None:
            self.metrics.snapshot_hits.inc()
            return state
        if not parked:
            self.metrics.snapshot_misses.inc()
        with self._load_lock:
            with self._lock:  # rebuilt, pushed or promoted while we waited for the lock
                state = self._touch(version)
                host_state = self._host.get(version)
            if state is not None:
                return state
            if host_state is not None:
                self.metrics.snapshot_hits.inc()
                self.metrics.snapshot_promotions.inc()
                return self.put(version, host_state)
            if parked:  # dropped from the host tier while we waited
                self.metrics.snapshot_misses.inc()
            if self.source is None:
                self.metrics.snapshot_unavailable.inc()
                return None
            try:
                loaded = self.source.load(version)
            except VersionUnavailable as err:
                log.warning("snapshot store: %s", err)
                self.metrics.snapshot_unavailable.inc()
                return None
            self.metrics.snapshot_rebuilds.inc()
            return self.put(version, loaded)

    def _touch(self, version: int) -> dict[str, torch.Tensor] | None:
        state = self._states.get(version)
        if state is not None:
            self._states.move_to_end(version)
        return state

    # --- writing --------------------------------------------------------------------------

    def put(self, version: int, state: StateDict) -> dict[str, torch.Tensor]:
        """Hold ``state`` as ``version`` on the device (most recently used), then evict to
        the budget."""
        converted = _convert(state, self.dtype, self.device)
        with self._lock:
            self._states[version] = converted
            self._states.move_to_end(version)
            self._host.pop(version, None)
            victims = self._evict_over_budget(keep=version)
        if victims:
            self._park(victims)
        return converted

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """``WeightFollower`` callback: hold each version as it is applied."""
        self.put(snapshot.version, snapshot.state)

    def retain(self, oldest: int) -> list[int]:
        """Drop versions older than ``oldest`` from both tiers; returns those dropped."""
        with self._lock:
            self._oldest = max(self._oldest, oldest)
            dropped = sorted(v for v in (*self._states, *self._host) if v < oldest)
            for version in dropped:
                self._states.pop(version, None)
                self._host.pop(version, None)
            self._account(len(dropped))
        return dropped

    def _evict_over_budget(self, keep: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Take LRU versions off the device until it fits the budget (never ``keep``); they
        are returned for the host tier, or dropped without one. Caller holds the lock."""
        self._account(0)
        victims = []
        while self._bytes > self.budget_bytes and len(self._states) > 1:
            victim = next(v for v in self._states if v != keep)
            victims.append((victim, self._states.pop(victim)))
            self._account(0)
        if self.host_budget_bytes is None:
            self._account(len(victims))
            return []
        return victims

    def _park(self, victims: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Copy versions the device evicted to host memory (outside the lock: a device to
        host copy of a large model takes a while), then hold them within the host budget.
        Meanwhile such a version is in neither tier: a ``get`` of it rebuilds it."""
        import torch

        cpu = torch.device("cpu")
        moved = [(version, _convert(state, None, cpu)) for version, state in victims]
        with self._lock:
            parked = 0
            for version, state in moved:
                # not put back, nor left the window, while it was copied
                if version not in self._states and version >= self._oldest:
                    self._host[version] = state
                    self._host.move_to_end(version)
                    parked += 1
            self.metrics.snapshot_demotions.inc(parked)
            dropped = 0
            self._account(0)
            while self._host_bytes > (self.host_budget_bytes or 0) and self._host:
                self._host.popitem(last=False)
                dropped += 1
                self._account(0)
            self._account(dropped)

    def _account(self, evicted: int) -> None:
        """Recount bytes of both tiers (each storage once) and update the gauges. Caller
        holds the lock."""
        self._bytes = _storage_bytes(self._states.values())
        self._host_bytes = _storage_bytes(self._host.values())
        if evicted:
            self.metrics.snapshot_evictions.inc(evicted)
        m = self.metrics
        m.snapshot_bytes.set(self._bytes)
        m.snapshot_versions.set(len(self._states))
        m.snapshot_host_bytes.set(self._host_bytes)
        m.snapshot_host_versions.set(len(self._host))


def snapshot_store_for(
    config: OldLogitsConfig,
    source: SnapshotSource | None,
    device: torch.device,
    metrics: StreamMetrics | None = None,
) -> SnapshotStore:
    """The store ``config`` describes on ``device`` (resolved once by the caller, which
    runs the model there too): a host tier only for ``snapshot_overflow = "host"`` on a
    device other than the CPU, whose memory the host tier would be."""
    import torch

    host = config.snapshot_overflow == "host" and device.type != "cpu"
    return SnapshotStore(
        source,
        budget_bytes=int(config.snapshot_memory_mb * MIB),
        dtype=getattr(torch, config.dtype),
        metrics=metrics,
        device=device,
        host_budget_bytes=int(config.snapshot_host_memory_mb * MIB) if host else None,
    )


def _storage_bytes(states: Iterable[Mapping[str, torch.Tensor]]) -> int:
    """Bytes of the storages behind ``states``, each counted once."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for state in states:
        for tensor in state.values():
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _convert(
    state: StateDict, dtype: torch.dtype | None, device: torch.device
) -> dict[str, torch.Tensor]:
    """``state`` on ``device``, in ``dtype`` (floating tensors only), detached; aliases
    stay aliases. Tensors already there in that dtype are not copied, so versions that
    share tensors (the follower's delta-rebuilt states) share them here too; moved to
    another device, each version is its own copy."""
    out: dict[str, torch.Tensor] = {}
    done: dict[tuple, torch.Tensor] = {}
    for name, tensor in state.items():
        # Aliases (tied weights) are views of one storage, not always one tensor object.
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
        )
        if key not in done:
            t = tensor.detach()
            target = dtype if dtype is not None and t.is_floating_point() else t.dtype
            if t.dtype != target or t.device != device:
                t = t.to(device=device, dtype=target)
            done[key] = t
        out[name] = done[key]
    return out


class FollowerFeed:
    """Runs a ``WeightFollower`` in a daemon thread, pushing each version it applies into
    a ``SnapshotStore`` (announcements from ``policy.versions`` plus polling the store)."""

    def __init__(self, follower: Any, listener: Any | None, poll_interval_s: float = 2.0) -> None:
        self.follower = follower
        self.listener = listener
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> FollowerFeed:
        self._thread = threading.Thread(target=self._run, name="weight-follower", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.follower.follow(
                self._stop, listener=self.listener, poll_interval_s=self.poll_interval_s
            )
        except Exception:  # the stream keeps running; misses rebuild from S3 on demand
            log.exception("weight follower stopped")

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.listener is not None:
            self.listener.close()
