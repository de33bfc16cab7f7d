"""The snapshot store: in-memory weights of recent policy versions, for exact old logits.

Seed 000's first exact repair ("snapshot-based version tracking"): keep θ_v for every
version still inside the staleness window. Versions arrive two ways:

- **pushed** by a ``WeightFollower`` callback (``FollowerFeed``) as the trainer publishes
  them, so the common case (a recent version) is a hit;
- **pulled** on a miss: ``get(v)`` asks its ``SnapshotSource`` to rebuild ``v`` (from the
  base and deltas in S3 for ``FollowerSource``). A version that cannot be rebuilt is
  reported unavailable (``None``), never guessed or replaced by a neighbour.

Memory: the store holds at most ``budget_bytes`` (tensors shared between versions, as the
follower's delta-rebuilt states share untouched tensors, count once); beyond it the least
recently used versions are evicted. The version being returned is never evicted, so a
single version larger than the budget still works. ``retain(oldest)`` drops versions that
left the staleness window.

Thread safety: ``put`` (follower thread), ``get`` (old-logit executor) and ``retain`` (event
loop) may run concurrently; one rebuild runs at a time.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from core.models import ModelSpec, build_tiny_llama, parse_model_spec
from streams.metrics import StreamMetrics

if TYPE_CHECKING:
    import torch

    from weights.follower import Snapshot
    from weights.store import WeightStore

log = logging.getLogger(__name__)

StateDict = Mapping[str, "torch.Tensor"]


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


class SnapshotStore:
    """Weights of recent versions in ``dtype``, LRU within ``budget_bytes``."""

    def __init__(
        self,
        source: SnapshotSource | None,
        *,
        budget_bytes: int,
        dtype: torch.dtype | None = None,
        metrics: StreamMetrics | None = None,
    ) -> None:
        self.source = source
        self.budget_bytes = int(budget_bytes)
        self.dtype = dtype
        self.metrics = metrics if metrics is not None else StreamMetrics()
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

    # --- reading --------------------------------------------------------------------------

    @property
    def versions(self) -> list[int]:
        """Held versions, least recently used first."""
        with self._lock:
            return list(self._states)

    @property
    def bytes(self) -> int:
        return self._bytes

    def __contains__(self, version: int) -> bool:
        with self._lock:
            return version in self._states

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of ``version``, rebuilt from the source on a miss; ``None`` if the
        source cannot provide it."""
        with self._lock:
            state = self._touch(version)
        if state is not None:
            self.metrics.snapshot_hits.inc()
            return state
        self.metrics.snapshot_misses.inc()
        with self._load_lock:
            with self._lock:  # rebuilt or pushed while we waited for the load lock
                state = self._touch(version)
            if state is not None:
                return state
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
        """Hold ``state`` as ``version`` (most recently used), then evict to the budget."""
        converted = _convert(state, self.dtype)
        with self._lock:
            self._states[version] = converted
            self._states.move_to_end(version)
            self._evict_over_budget(keep=version)
        return converted

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """``WeightFollower`` callback: hold each version as it is applied."""
        self.put(snapshot.version, snapshot.state)

    def retain(self, oldest: int) -> list[int]:
        """Drop versions older than ``oldest``; returns those dropped."""
        with self._lock:
            dropped = [v for v in self._states if v < oldest]
            for version in dropped:
                del self._states[version]
            self._account(len(dropped))
        return dropped

    def _evict_over_budget(self, keep: int) -> None:
        self._account(0)
        evicted = 0
        while self._bytes > self.budget_bytes and len(self._states) > 1:
            victim = next(v for v in self._states if v != keep)
            del self._states[victim]
            evicted += 1
            self._account(0)
        if evicted:
            self.metrics.snapshot_evictions.inc(evicted)

    def _account(self, evicted: int) -> None:
        """Recount bytes (each storage once) and update the gauges. Caller holds the lock."""
        seen: set[int] = set()
        total = 0
        for state in self._states.values():
            for tensor in state.values():
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
        self._bytes = total
        if evicted:
            self.metrics.snapshot_evictions.inc(evicted)
        self.metrics.snapshot_bytes.set(total)
        self.metrics.snapshot_versions.set(len(self._states))


def _convert(state: StateDict, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` in ``dtype`` (floating tensors only), detached; aliases stay aliases."""
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
        )
        if key not in done:
            t = tensor.detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
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
