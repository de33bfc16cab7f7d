"""What the stream does with one message, as plain Python (no Faust, no Kafka, no torch).

``Processor.handle`` turns a consumed message into a ``Step``: the messages to produce,
the table writes, and the groups to close. Closing a group that will be emitted needs
old logits first; the caller computes them off the event loop (``OldLogitEngine``) and
hands them to ``Processor.finish``, which adds the scored group (or its dead letters)
and the source-offset watermark. The caller then applies the whole step atomically
(``streams.faust.txn``). Reads come from the table as it was before the step; within a step
every write goes to a different key, except the group state, which is written once.

A raw record goes through, in order:

1. **replay check**: at or below the partition's watermark → already applied, skip;
2. **decode + validate** (``schemas.codec``, ``schemas.validation``, with the vocabulary
   and context length of the model the old-logit pass runs) → DLQ with the codec's or
   the validator's reason code, the original bytes and headers, and the source
   topic/partition/offset (``schemas.control.DeadLetter``);
3. **routing checks**: another run's record (``foreign_run``), another policy's record
   (``foreign_policy``: a multi-policy run's policies have their own topics, so only a
   misrouted record meets this), a Kafka key that is not
   the group id (``key_mismatch``: the group could be split across partitions), a
   routing header (``rs-run-id``, ``rs-group-id``, ...) that contradicts the body
   (``header_mismatch``);
4. **versions** (``StalenessPolicy``, against the newest announced version): a version
   never published (ahead by more than ``future_allowance``) → DLQ ``future_version``;
   too stale → ``rollouts.stale`` with ``StaleRecord``;
5. **assembly**: the sample joins its group's table entry; a duplicate
   (``duplicate_sample``), a taken sample index (``duplicate_sample_index``), a group size
   that disagrees (``group_size_mismatch``) or a sample of an already closed group
   (``late_sample``) goes to the DLQ instead. Stale samples of the group (and those of a
   version never published) are counted as *dropped*, so a group whose every sample is
   accounted for closes at once. A record refused at steps 2-3 changes no group: what it
   claims is untrusted, and a single bad record keyed like a real group must not close it
   (its group then closes at the timeout if that sample never comes).

A tick (the internal ``ticks`` topic, same partitioning) closes the partition's groups
older than ``timeout_s`` and forgets closed-group markers past ``emitted_retention_s``.

Closing: every sample is judged again against the version at that moment (staleness is
recorded as of emission; ``ScoredGroup.trainer_version_seen`` is that version), and a
sample that has become stale waiting for its group goes to ``rollouts.stale`` as if it
had arrived stale. Then: all ``group_size`` samples → emitted complete. Fewer (timeout,
or some dropped) → ``partial_policy="emit"`` emits them flagged partial if at least
``min_partial_samples`` are present; otherwise each goes to the DLQ as
``incomplete_group``.

**Data operators** (``[[streams.operators]]``, ``streams.operators``) then run on an emitted
group, in order: each keeps it, changes it (rewards; advantages are computed after the
chain, from the final rewards), takes samples out, or filters the whole group. Every
sample taken out goes to ``rollouts.filtered`` with its original bytes and an
``rs-filtered`` header (``FilteredGroup``: operator and reason); nothing is dropped
silently. An operator that raises or breaks its contract fails the group as
``operator_failed`` (below).

A group whose closing fails (reading its samples, the old-logit forward pass, an
operator, building the scored group) is closed as ``failed``: every one of its samples goes
to the DLQ as ``group_failed`` (``operator_failed`` for an operator) with the error and its
original bytes, once (the closed marker stops ticks from trying again), and
``groups_total{outcome="failed"}`` counts it. A scored group too large for its topic
(``max.message.bytes`` less its key, headers and batch framing) is refused before it is
sent, its samples dead-lettered as ``group_too_large``: the broker would refuse it in every
replay of the step, and the worker would never get past it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

from schemas.codec import (
    COMPLETE_HEADER,
    DEAD_LETTER_HEADER,
    FILTERED_HEADER,
    GROUP_ID_HEADER,
    MIN_VERSION_HEADER,
    RUN_ID_HEADER,
    STALE_HEADER,
    DecodeError,
    decode,
    header_disagreements,
    parse_headers,
    routing_headers,
)
from schemas.control import (
    DeadLetter,
    FilteredGroup,
    PromptStats,
    StaleRecord,
    prompt_key,
)
from schemas.group import GroupTooLarge, encode_group
from schemas.topics import ROLLOUTS_SCORED, value_room
from schemas.trajectory import NO_VERSION, Trajectory
from schemas.validation import ValidationLimits, validate
from streams.config import StreamsConfig
from streams.groups import (
    GROUP_PREFIX,
    GroupState,
    SampleEntry,
    build_scored_group,
    group_key,
    offset_key,
    prompt_stats_key,
    sample_key,
)
from streams.metrics import StreamMetrics
from streams.operators import Drop, Keep, OperatorError, apply_chain, build_chain
from streams.staleness import StalenessPolicy, VersionTracker

log = logging.getLogger(__name__)

Headers = tuple[tuple[str, bytes], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """A consumed Kafka message, client-independent."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """A message to produce."""

    topic: str
    key: bytes | None
    value: bytes
    headers: Headers = ()


@dataclasses.dataclass(slots=True)
class Closing:
    """A group to close. ``emit``: it becomes a ScoredGroup (old logits needed first);
    otherwise each of ``raw`` is dead-lettered with ``reason``. ``version``: the trainer
    version the samples were judged against at closing (the emitted group's
    ``trainer_version_seen``)."""

    state: GroupState
    samples: list[Trajectory]
    raw: list[bytes]  # the samples' original record bytes, same order
    emit: bool
    outcome: str  # complete | partial | dropped | failed
    version: int = NO_VERSION
    reason: str = "incomplete_group"
    detail: str = ""
    offsets: list[int] = dataclasses.field(default_factory=list)  # source offsets, same order


@dataclasses.dataclass(slots=True)
class Step:
    """Everything one message causes; applied atomically by the caller."""

    message: Message
    sends: list[Send] = dataclasses.field(default_factory=list)
    writes: list[tuple[bytes, bytes | None]] = dataclasses.field(default_factory=list)
    closings: list[Closing] = dataclasses.field(default_factory=list)
    skipped: bool = False
    #: each data operator's decision, per emitted group id (``replay --rerun stream``)
    operator_trace: dict[str, tuple[tuple[str, str], ...]] = dataclasses.field(default_factory=dict)

    @property
    def partition(self) -> int:
        """Table (changelog) partition of every write: the source partition."""
        return self.message.partition


class DeadLetterReason:
    """Reason codes the stream itself adds to those of the codec and the validator."""

    FOREIGN_RUN = "foreign_run"
    FOREIGN_POLICY = "foreign_policy"
    KEY_MISMATCH = "key_mismatch"
    DUPLICATE_SAMPLE = "duplicate_sample"
    DUPLICATE_SAMPLE_INDEX = "duplicate_sample_index"
    GROUP_SIZE_MISMATCH = "group_size_mismatch"
    LATE_SAMPLE = "late_sample"
    INCOMPLETE_GROUP = "incomplete_group"
    PROCESSING_ERROR = "processing_error"
    HEADER_MISMATCH = "header_mismatch"
    FUTURE_VERSION = "future_version"
    GROUP_FAILED = "group_failed"
    OPERATOR_FAILED = "operator_failed"
    GROUP_TOO_LARGE = "group_too_large"


_NAMED_FAILURES = (DeadLetterReason.OPERATOR_FAILED, DeadLetterReason.GROUP_TOO_LARGE)
"""Closing failures dead-lettered under their own reason rather than ``group_failed``."""


class Processor:
    """The stream's decisions, given the table's current contents."""

    def __init__(
        self,
        config: StreamsConfig,
        run_id: str,
        tracker: VersionTracker,
        table: Mapping[bytes, bytes],
        metrics: StreamMetrics | None = None,
        *,
        model_vocab_size: int | None = None,
        model_context: int | None = None,
        served_policy: str = "",
    ) -> None:
        """``model_vocab_size``/``model_context``: of the model old logits are computed
        with (``streams.oldlogits.model_limits``); a record outside them is invalid.
        ``served_policy``: the policy of a multi-policy run whose records this stream
        scores; a record of another policy is never scored with this policy's weights."""
        self.config = config
        self.run_id = run_id
        self.served_policy = served_policy
        self.tracker = tracker
        self.table = table
        self.metrics = metrics if metrics is not None else StreamMetrics()
        self.policy = StalenessPolicy(config.staleness)
        v = config.validation
        vocab = [n for n in (v.vocab_size, model_vocab_size) if n is not None]
        self.limits = ValidationLimits(
            vocab_size=min(vocab) if vocab else None,
            max_total_tokens=model_context,
            max_prompt_tokens=v.max_prompt_tokens,
            max_response_tokens=v.max_response_tokens,
            max_record_bytes=v.max_record_bytes,
            max_group_size=v.max_group_size,
        )
        self.topics = config.topics
        self.ticks_topic = config.ticks_topic
        self.operators = build_chain([spec.model_dump() for spec in config.operators])

    # --- entry points ---------------------------------------------------------------------

    def handle(self, msg: Message, now_ms: int) -> Step:
        """The step for ``msg`` (old logits of emitted groups still to be attached)."""
        step = Step(msg)
        self.metrics.records_in.labels(topic=msg.topic).inc()
        watermark = self.table.get(offset_key(msg.topic, msg.partition))
        if watermark is not None and msg.offset <= int(watermark):
            step.skipped = True
            return step
        if msg.topic == self.ticks_topic:
            self._tick(step, now_ms)
        else:
            self._record(step, now_ms)
        return step

    def unannounced_version(self, msg: Message) -> int | None:
        """The version a raw record's ``rs-max-version`` header claims, when it is beyond
        every version known (announced plus the allowance, or vouched for): the weight
        store may hold it (``streams.versions.VersionVoucher``) before its announcement
        arrives. None otherwise, and for a message without readable routing headers (the
        record's own checks say what is wrong with it)."""
        if msg.topic == self.ticks_topic or self.tracker.version == NO_VERSION:
            return None
        try:
            claimed = parse_headers(msg.headers).max_version
        except DecodeError:
            return None
        known = self.policy.newest_known(self.tracker.version, self.tracker.vouched)
        return claimed if claimed > known else None

    def finish(
        self,
        step: Step,
        attached: Mapping[str, list[Trajectory]],
        now_ms: int,
        failed: Mapping[str, str] | None = None,
    ) -> Step:
        """Add the closings' outputs (``attached``: emitted groups' samples with old logits,
        by group id; ``failed``: why an emitted group's old logits could not be had, by
        group id) and the watermark write. Returns ``step``."""
        if step.skipped:
            return step
        failed = failed or {}
        for closing in step.closings:
            state = closing.state
            if closing.emit:
                why = failed.get(state.group_id)
                sends = None
                if why is None:
                    try:
                        sends = self._scored(step, closing, attached[state.group_id], now_ms)
                    except OperatorError as err:  # user code: the group fails, named
                        why = str(err)
                        closing.reason = DeadLetterReason.OPERATOR_FAILED
                    except GroupTooLarge as err:  # the broker would refuse it, every time
                        why = f"{err} (the room {self.topics.scored} leaves a value)"
                        closing.reason = DeadLetterReason.GROUP_TOO_LARGE
                    except Exception as err:  # a bug: the group fails, the worker goes on
                        log.exception("building group %s failed", state.group_id)
                        why = f"{type(err).__name__}: {err}"
                if sends is not None:
                    step.sends.extend(sends)
                    if closing.outcome != "filtered":
                        self.metrics.records_out.labels(topic=self.topics.scored).inc()
                        latency = max(0, now_ms - state.first_seen_ms) / 1000
                        self.metrics.group_latency.observe(latency)
                else:
                    closing.emit, closing.outcome = False, "failed"
                    if closing.reason not in _NAMED_FAILURES:
                        closing.reason = DeadLetterReason.GROUP_FAILED
                    closing.detail = f"group {state.group_id} failed to close: {why}"
            if not closing.emit:
                self._dead_letter_closing(step, closing)
            self.metrics.groups.labels(outcome=closing.outcome).inc()
            for entry in state.samples:
                step.writes.append((sample_key(state.group_id, entry.trajectory_id), None))
            marker = state.closed_as(closing.outcome, now_ms)
            keep = self.config.groups.emitted_retention_s > 0
            step.writes.append((group_key(state.group_id), marker.to_bytes() if keep else None))
        msg = step.message
        step.writes.append((offset_key(msg.topic, msg.partition), str(msg.offset).encode()))
        return step

    def failed(self, msg: Message, error: BaseException) -> Step:
        """The step for a message whose processing raised (a bug, not bad input): a raw
        record goes to the DLQ as ``processing_error`` and the worker moves on (a tick,
        which has no bytes of its own, is only counted: the groups it would have closed
        are closed, or failed, by ``_close`` itself)."""
        step = Step(msg)
        self.metrics.processing_errors.labels(topic=msg.topic).inc()
        if msg.topic != self.ticks_topic:
            detail = f"{type(error).__name__}: {error}"
            self._reject(step, DeadLetterReason.PROCESSING_ERROR, detail)
        step.writes.append((offset_key(msg.topic, msg.partition), str(msg.offset).encode()))
        return step

    def due_partitions(self, now_ms: int) -> set[int]:
        """Partitions holding a group past its timeout or a marker past its retention."""
        due: set[int] = set()
        for _key, state in self._group_states():
            if self._is_due(state, now_ms):
                due.add(state.partition)
        return due

    # --- raw records ----------------------------------------------------------------------

    def _record(self, step: Step, now_ms: int) -> None:
        msg = step.message
        value = msg.value if msg.value is not None else b""
        try:
            traj = decode(value, max_bytes=self.limits.max_record_bytes)
        except DecodeError as err:
            self._reject(step, str(err.reason), err.message)
            return
        defects = validate(traj, self.limits)
        if defects:
            detail = "; ".join(str(d) for d in defects)
            # Only this record: anything it claims (its group, size, index) is untrusted, and
            # letting it count in the group would let one bad record close a real group.
            self._reject(step, str(defects[0].reason), detail)
            return
        misrouted = self._misrouted(traj, msg.key, msg.headers)
        if misrouted is not None:
            self._reject(step, *misrouted)
            return
        trainer = self.tracker.version
        verdict = self.policy.judge(
            traj.min_version, trainer, traj.max_version, self.tracker.vouched
        )
        if verdict.future:
            self._reject(step, DeadLetterReason.FUTURE_VERSION, self._future_detail(traj, trainer))
            self._drop_from_group(step, traj, now_ms)
            return
        if not verdict.admitted:
            stale = StaleRecord(traj.trajectory_id, verdict.staleness, trainer, verdict.limit)
            self._send(
                step, self.topics.stale, msg.key, value, (*_strip(msg.headers), stale.header())
            )
            self.metrics.stale.inc()
            self._drop_from_group(step, traj, now_ms)
            return
        self._add_to_group(step, traj, verdict.staleness, now_ms)

    def _misrouted(
        self, traj: Trajectory, key: bytes | None, headers: Headers
    ) -> tuple[DeadLetterReason, str] | None:
        """Why a valid record is not this stream's to score (another run or policy, or a
        key or routing headers that disagree with its body), or None."""
        if traj.run_id != self.run_id:
            return (
                DeadLetterReason.FOREIGN_RUN,
                f"run {traj.run_id!r}, stream serves {self.run_id!r}",
            )
        if traj.policy != self.served_policy:
            policy, served = traj.policy, self.served_policy
            return DeadLetterReason.FOREIGN_POLICY, f"policy {policy!r}, stream serves {served!r}"
        if key != traj.group_id.encode():
            return (
                DeadLetterReason.KEY_MISMATCH,
                f"key {key!r} is not the group id {traj.group_id!r}",
            )
        disagreements = header_disagreements(traj, headers)
        if disagreements:
            detail = "routing headers contradict the body: " + "; ".join(disagreements)
            return DeadLetterReason.HEADER_MISMATCH, detail
        return None

    def _add_to_group(self, step: Step, traj: Trajectory, staleness: int, now_ms: int) -> None:
        msg = step.message
        state = self._load_group(traj.group_id, msg.partition, now_ms)
        reason = detail = None
        if state.closed:
            reason = DeadLetterReason.LATE_SAMPLE
            detail = f"group {traj.group_id} was closed ({state.outcome}) at {state.closed_ms}"
        elif state.has(traj.trajectory_id):
            reason = DeadLetterReason.DUPLICATE_SAMPLE
            detail = f"trajectory {traj.trajectory_id} already in group {traj.group_id}"
        elif state.group_size is not None and state.group_size != traj.group_size:
            reason = DeadLetterReason.GROUP_SIZE_MISMATCH
            detail = f"group_size {traj.group_size}, group {traj.group_id} has {state.group_size}"
        elif any(s.sample_index == traj.sample_index for s in state.samples):
            reason = DeadLetterReason.DUPLICATE_SAMPLE_INDEX
            detail = f"sample_index {traj.sample_index} already taken in group {traj.group_id}"
        if reason is not None:
            self._reject(step, reason, detail or "")
            return
        entry = SampleEntry(traj.trajectory_id, traj.sample_index, staleness, msg.offset)
        state = state.with_sample(entry, traj.group_size)
        assert msg.value is not None
        step.writes.append((sample_key(traj.group_id, traj.trajectory_id), msg.value))
        self._store_or_close(step, state, {traj.trajectory_id: (traj, msg.value)})

    def _drop_from_group(self, step: Step, traj: Trajectory, now_ms: int) -> None:
        """Count a valid but stale (or never-published version's) sample as accounted for
        in its group, so the group need not wait for its timeout."""
        state = self._load_group(traj.group_id, step.message.partition, now_ms)
        if state.closed or state.has(traj.trajectory_id):
            return
        self._store_or_close(step, state.with_dropped(traj.trajectory_id, traj.group_size), {})

    def _store_or_close(
        self, step: Step, state: GroupState, fresh: Mapping[str, tuple[Trajectory, bytes]]
    ) -> None:
        if state.ready:
            self._close(step, state, fresh)
        else:
            step.writes.append((group_key(state.group_id), state.to_bytes()))

    # --- ticks ----------------------------------------------------------------------------

    def _tick(self, step: Step, now_ms: int) -> None:
        for key, state in self._group_states():
            if state.partition != step.partition or not self._is_due(state, now_ms):
                continue
            if state.closed:
                step.writes.append((key, None))  # forget the marker
            else:
                self._close(step, state, {})

    def _is_due(self, state: GroupState, now_ms: int) -> bool:
        groups = self.config.groups
        if state.closed:
            assert state.closed_ms is not None
            return now_ms - state.closed_ms >= groups.emitted_retention_s * 1000
        return now_ms - state.first_seen_ms >= groups.timeout_s * 1000

    # --- helpers --------------------------------------------------------------------------

    def _close(
        self, step: Step, state: GroupState, fresh: Mapping[str, tuple[Trajectory, bytes]]
    ) -> None:
        """Queue ``state``'s group for closing; its samples come from the table (or
        ``fresh``, for the one arriving in this step). Each sample is judged again at the
        version of this moment: one that has become stale goes to the stale topic now,
        and the group closes with the rest, as if it had arrived stale."""
        sends, writes = len(step.sends), len(step.writes)
        try:
            closing = self._closing(step, state, fresh)
        except Exception as err:  # a bug: fail the group rather than the whole step
            log.exception("closing group %s failed", state.group_id)
            del step.sends[sends:], step.writes[writes:]  # nothing of the attempt remains
            closing = self._failed_closing(state, fresh, err)
        step.closings.append(closing)

    def _closing(
        self, step: Step, state: GroupState, fresh: Mapping[str, tuple[Trajectory, bytes]]
    ) -> Closing:
        version = self.tracker.version
        samples: list[Trajectory] = []
        raws: list[bytes] = []
        kept: list[SampleEntry] = []
        for entry in state.samples:
            if entry.trajectory_id in fresh:
                traj, raw = fresh[entry.trajectory_id]
            else:
                raw = self.table[sample_key(state.group_id, entry.trajectory_id)]
                traj = decode(raw)  # validated on arrival
            verdict = self.policy.judge(
                traj.min_version, version, traj.max_version, self.tracker.vouched
            )
            if verdict.admitted:
                samples.append(traj)
                raws.append(raw)
                kept.append(dataclasses.replace(entry, staleness=verdict.staleness))
                continue
            step.writes.append((sample_key(state.group_id, entry.trajectory_id), None))
            source = (self.topics.raw, state.partition, entry.offset)
            headers = tuple(routing_headers(traj))
            if verdict.future:  # arrived before any version was known
                self._dead_letter(
                    step,
                    DeadLetterReason.FUTURE_VERSION,
                    self._future_detail(traj, version),
                    key=state.group_id.encode(),
                    value=raw,
                    headers=headers,
                    source=source,
                )
                continue
            stale = StaleRecord(traj.trajectory_id, verdict.staleness, version, verdict.limit)
            self._send(
                step, self.topics.stale, state.group_id.encode(), raw, (*headers, stale.header())
            )
            self.metrics.stale.inc()
            self.metrics.stale_at_close.inc()
        state = dataclasses.replace(state, samples=tuple(kept))
        groups = self.config.groups
        n = len(samples)
        if n == state.group_size:
            outcome, emit = "complete", True
        elif n and groups.partial_policy == "emit" and n >= groups.min_partial_samples:
            outcome, emit = "partial", True
        else:
            outcome, emit = "dropped", False
        return Closing(
            state,
            samples,
            raws,
            emit,
            outcome,
            version=version,
            detail=f"group {state.group_id} closed with {n} of {state.group_size} samples",
            offsets=[e.offset for e in kept],
        )

    def _failed_closing(
        self,
        state: GroupState,
        fresh: Mapping[str, tuple[Trajectory, bytes]],
        error: BaseException,
    ) -> Closing:
        """Every sample of a group whose closing raised, to be dead-lettered: the bytes
        as they arrived (from the table, or ``fresh``)."""
        raws: list[bytes] = []
        offsets: list[int] = []
        for entry in state.samples:
            if entry.trajectory_id in fresh:
                raw = fresh[entry.trajectory_id][1]
            else:
                raw = self.table.get(sample_key(state.group_id, entry.trajectory_id), b"")
            raws.append(raw)
            offsets.append(entry.offset)
        return Closing(
            state,
            [],
            raws,
            False,
            "failed",
            version=self.tracker.version,
            reason=DeadLetterReason.GROUP_FAILED,
            detail=f"group {state.group_id} failed to close: {type(error).__name__}: {error}",
            offsets=offsets,
        )

    def _scored(
        self, step: Step, closing: Closing, samples: list[Trajectory], now_ms: int
    ) -> list[Send]:
        """The messages of an emitted group: the data operators run first; the group goes
        to ``rollouts.scored`` (advantages from its final rewards) unless an operator
        filters it, and every sample an operator takes out goes to ``rollouts.filtered``
        with its original bytes. Nothing is sent if anything here raises."""
        state = closing.state
        ordered = sorted(samples, key=lambda t: (t.sample_index, t.trajectory_id))
        chain = apply_chain(self.operators, ordered)
        sends: list[Send] = []
        raw = dict(zip((t.trajectory_id for t in closing.samples), closing.raw, strict=True))
        filtered = [(op, "removed", t) for op, t in chain.removed]
        if isinstance(chain.decision, Drop):
            dropped_by = chain.dropped_by or "?"
            taken_out = {t.trajectory_id for _, t in chain.removed}
            filtered += [
                (dropped_by, chain.decision.reason, t)
                for t in ordered
                if t.trajectory_id not in taken_out
            ]
        for operator, reason, traj in filtered:  # apply_chain: only samples of the group
            note = FilteredGroup(state.group_id, operator, reason)
            headers = (*routing_headers(traj), note.header())
            value = raw[traj.trajectory_id]
            sends.append(Send(self.topics.filtered, state.group_id.encode(), value, headers))
        if isinstance(chain.decision, Keep):
            group = build_scored_group(
                self.run_id,
                state,
                chain.decision.samples,
                trainer_version=closing.version,
                now_ms=now_ms,
                normalize_std=self.config.groups.normalize_std,
                eps=self.config.groups.eps,
            )
            headers = (
                (RUN_ID_HEADER, self.run_id.encode()),
                (GROUP_ID_HEADER, state.group_id.encode()),
                (COMPLETE_HEADER, b"1" if group.complete else b"0"),
                # the trainer orders by it without decoding (earliest deadline first)
                (MIN_VERSION_HEADER, str(min(t.min_version for t in group.samples)).encode()),
            )
            key = state.group_id.encode()
            room = value_room(ROLLOUTS_SCORED, key, headers)
            value = encode_group(group, max_bytes=room)
            sends.append(Send(self.topics.scored, key, value, headers))
        else:
            closing.outcome = "filtered"
        sends.extend(self._prompt_stats(step, state.partition, ordered, closing.version))
        step.operator_trace[state.group_id] = chain.trace
        for operator, decision in chain.trace:
            self.metrics.operator_decisions.labels(operator=operator, decision=decision).inc()
        for operator, reason, _ in filtered:
            self.metrics.filtered.labels(operator=operator, reason=reason).inc()
            self.metrics.records_out.labels(topic=self.topics.filtered).inc()
        return sends

    def _prompt_stats(
        self, step: Step, partition: int, samples: list[Trajectory], version: int
    ) -> list[Send]:
        """The group's prompt statistics, folded into this partition's running totals
        (a table entry, written in the same step) and published to ``prompts.stats``."""
        cfg = self.config.prompt_stats
        if not cfg.enabled or not samples:
            return []
        key = prompt_key(samples[0].prompt_ids)
        table_key = prompt_stats_key(partition, key)
        before = self.table.get(table_key)
        old = PromptStats.from_json(before) if before is not None else None
        rewards = [t.reward for t in samples]
        stats = PromptStats(
            run_id=self.run_id,
            prompt_key=key,
            partition=partition,
            samples=len(rewards) + (old.samples if old else 0),
            passes=sum(r >= cfg.pass_threshold for r in rewards) + (old.passes if old else 0),
            reward_sum=float(sum(rewards)) + (old.reward_sum if old else 0.0),
            last_version=max(version, max(t.max_version for t in samples)),
        )
        step.writes.append((table_key, stats.to_json()))
        return [Send(self.topics.prompt_stats, stats.key, stats.to_json(), ())]

    def _dead_letter_closing(self, step: Step, closing: Closing) -> None:
        """Each sample of a group that is not emitted, with its original bytes."""
        state = closing.state
        if closing.outcome == "failed":
            self.metrics.group_failures.inc()
        for raw, offset in zip(closing.raw, closing.offsets, strict=True):
            try:
                headers: Headers = tuple(routing_headers(decode(raw)))
            except DecodeError:
                headers = ()
            self._dead_letter(
                step,
                closing.reason,
                closing.detail,
                key=state.group_id.encode(),
                value=raw,
                headers=headers,
                source=(self.topics.raw, state.partition, offset),
            )

    def _future_detail(self, traj: Trajectory, version: int) -> str:
        allowance = self.config.staleness.future_allowance
        return (
            f"segment_versions reach {traj.max_version}, the newest announced version is "
            f"{version} (allowance {allowance}): a version never published"
        )

    def _load_group(self, group_id: str, partition: int, now_ms: int) -> GroupState:
        raw = self.table.get(group_key(group_id))
        if raw is None:
            return GroupState(group_id, partition, now_ms)
        return GroupState.from_bytes(raw)

    def _group_states(self) -> Iterable[tuple[bytes, GroupState]]:
        for key, value in list(self.table.items()):
            if key.startswith(GROUP_PREFIX) and value is not None:
                yield key, GroupState.from_bytes(value)

    def _reject(self, step: Step, reason: str, detail: str) -> None:
        msg = step.message
        self._dead_letter(
            step,
            reason,
            detail,
            key=msg.key,
            value=msg.value if msg.value is not None else b"",
            headers=msg.headers,
            source=(msg.topic, msg.partition, msg.offset),
        )

    def _dead_letter(
        self,
        step: Step,
        reason: str,
        detail: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: Headers,
        source: tuple[str, int, int],
    ) -> None:
        letter = DeadLetter(reason, detail[:4000], *source)
        self._send(step, self.topics.dlq, key, value, (*_strip(headers), letter.header()))
        self.metrics.dlq.labels(reason=reason).inc()

    def _send(
        self, step: Step, topic: str, key: bytes | None, value: bytes, headers: Headers
    ) -> None:
        step.sends.append(Send(topic, key, value, tuple(headers)))
        self.metrics.records_out.labels(topic=topic).inc()


def _strip(headers: Headers) -> Headers:
    """The original headers minus an earlier dead-letter or stale header (a replayed
    record would otherwise carry two), each key once (the first): readers of the DLQ and
    stale topics parse the headers as a mapping, and a record that repeats a header must
    stay readable there."""
    seen: set[str] = set()
    kept = []
    for key, value in headers:
        if key in (DEAD_LETTER_HEADER, STALE_HEADER, FILTERED_HEADER) or key in seen:
            continue
        seen.add(key)
        kept.append((key, value))
    return tuple(kept)
