"""Gateway episodes: what agents calling the OpenAI-compatible API (``producers.gateway``)
make of a group, call by call, holding the exact tokens the engine saw and produced.

The worker admits a group as for any task (credit, staleness window) and hands it to the
``EpisodeDesk`` as G open slots; an agent opens an episode (claims a slot), makes calls and
closes it with a reward. Each call's prompt is the agent's history rendered to tokens;
``GatewayEpisode.place`` sets it against what the episode holds so far:

- it extends the episode's prompt + response tokens: the new tokens are an environment
  turn (masked from every loss) and the call's completion is the next policy turn;
- it does not (the agent edited its history, or re-rendering changed tokens): by
  ``history_mismatch``, the episode's record so far is kept and another record of the
  episode starts at this prompt (``split``), or the call is refused (``refuse``).

So a record only ever holds policy tokens the engine generated, in the context it
generated them in. The group is published once every slot is closed or abandoned; the
abandoned ones (no call for ``idle_timeout_s``, a slot never opened, a client that left
before its answer, the producer stopping) are never published, and the ledger says why.
A closed episode is therefore not durable when its close is answered: it waits for its
group (``GatewayEpisode.fate``). What is durable is that it existed: each completed call
is an ``episode_call`` line of the producer's ledger before its answer is returned, so a
producer killed mid-episode closes the episodes it held as abandoned when it restarts
(``Ledger.close_interrupted``), and answers their agents 409 with the reason. When the
producer stops first, ``play`` returns the closed episodes of the unfinished group
(``GroupOutcome.stopped``) for the worker to publish or dead-letter: none is dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from producers.config import GatewayConfig
from producers.gateway.retries import CallMemo
from producers.rollout.desk import GroupOutcome
from producers.rollout.episodes import EpisodeResult, PolicyTurn
from producers.rollout.ledger import CallCounts, Ledger
from producers.rollout.metrics import ProducerMetrics
from producers.rollout.versions import Stopped, StopSignals
from producers.tasks.base import Prompt
from producers.tasks.environments import EpisodeLimits
from schemas.trajectory import EpisodeEnd, TurnKind

LEFT_BEFORE_ANSWER = "the client left before its answer"
"""Why an episode whose last turn never reached its agent (and no retry fetched it) ends."""

REMEMBERED_EPISODES = 10_000
"""Finished episodes remembered, so a late call or a second reward is told what became of
its episode rather than that it never existed."""


class EpisodeRefused(Exception):
    """A call or a reward the episode cannot take; ``status`` is the HTTP answer."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class EpisodeEnded(EpisodeRefused):
    """An episode an earlier run of this producer abandoned (the ledger says why)."""

    def __init__(self, episode_id: str, reason: str) -> None:
        super().__init__(f"episode {episode_id} is abandoned: {reason}", 409)
        self.reason = reason


class HistoryRefused(EpisodeRefused):
    """A call whose history does not extend its episode, under ``history_mismatch =
    'refuse'``."""


@dataclass
class EpisodePart:
    """One record of an episode: the prompt tokens it starts from and what followed."""

    prompt_ids: list[int]
    result: EpisodeResult = field(default_factory=EpisodeResult)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.result.response_ids

    @property
    def policy_turns(self) -> int:
        return self.result.turn_kinds.count(TurnKind.POLICY)


Retokenize = Callable[[list[int], str], list[int] | None]
"""``(context ids, rendered text) -> ids``: the context followed by the tokens of the text
past it, when the text begins with the context's text; else None."""


@dataclass
class GatewayEpisode:
    """One slot of a group, and what the agent that opened it has done with it."""

    episode_id: str
    group_id: str
    index: int
    prompt: Prompt
    limits: EpisodeLimits
    mismatch: str  # GatewayConfig.history_mismatch
    created: float = field(default_factory=time.monotonic)
    state: str = "open"  # open (unclaimed), active, closed, abandoned
    parts: list[EpisodePart] = field(default_factory=list)
    last_activity: float = field(default_factory=time.monotonic)
    busy: bool = False  # a call in flight
    reason: str = ""  # why it was abandoned
    calls: int = 0
    mismatches: int = 0
    tool_messages: int = 0
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    # a closed episode's records: "" while its group waits, then what the worker did with
    # them ("publishing" or "dead_lettering")
    fate: str = ""
    last_call: CallMemo | None = None  # what a retry of the last call is answered

    @property
    def done(self) -> bool:
        return self.state in ("closed", "abandoned")

    def check_open(self) -> None:
        if self.state != "active":
            detail = f": {self.reason}" if self.reason else ""
            raise EpisodeRefused(f"episode {self.episode_id} is {self.state}{detail}")

    def place(self, ids: list[int], text: str, retokenize: Retokenize) -> tuple[list[int], int]:
        """The history a call generates from, given its rendered prompt (``ids``, ``text``),
        and how many response tokens it may add; the environment tokens it brings are added
        to the episode. Raises ``EpisodeRefused`` when it cannot be placed."""
        self.check_open()
        if not self.parts:
            return self._start_part(ids)
        part = self.parts[-1]
        if not part.policy_turns:  # its first call never got an answer: start it again
            self.parts.pop()
            return self._start_part(ids)
        context = part.context
        history = ids if ids[: len(context)] == context else retokenize(context, text)
        if history is None:
            self.mismatches += 1
            if self.mismatch == "refuse":
                raise HistoryRefused(
                    "the messages do not extend this episode's history (an earlier turn "
                    "was edited or renders to other tokens); history_mismatch = 'refuse'"
                )
            return self._start_part(ids)
        env = history[len(context) :]
        room = self._room(part, len(env))
        if env:
            part.result.add_env_turn(env)
        return history, room

    def _start_part(self, ids: list[int]) -> tuple[list[int], int]:
        part = EpisodePart(list(ids))
        room = self._room(part, 0)
        self.parts.append(part)
        return list(ids), room

    def _room(self, part: EpisodePart, env_tokens: int) -> int:
        limits = self.limits
        if part.policy_turns >= limits.max_turns:
            part.result.end = EpisodeEnd.MAX_TURNS
            raise EpisodeRefused(f"the episode made its {limits.max_turns} calls (max_turns)", 400)
        room = limits.max_total_tokens - len(part.result.response_ids) - env_tokens
        if room <= 0:
            part.result.end = EpisodeEnd.MAX_TOKENS
            raise EpisodeRefused(
                f"the episode's {limits.max_total_tokens} response tokens are spent "
                "(max_total_tokens)",
                400,
            )
        return room

    def add_turn(self, turn: PolicyTurn) -> None:
        """The policy's answer to the call just placed."""
        if turn.response_ids:
            self.parts[-1].result.add_policy_turn(turn)
        self.calls += 1
        self.last_activity = time.monotonic()

    def records(self) -> list[tuple[Prompt, EpisodeResult]]:
        """The episode's records: one per part that holds a policy turn."""
        kept = [p for p in self.parts if p.policy_turns]
        records = []
        for number, part in enumerate(kept):
            result = part.result
            result.tool_calls = self.tool_messages if number == len(kept) - 1 else 0
            result.details = {
                **result.details,
                "turns": part.policy_turns,
                "episode_end": result.end.value,
                "gateway": {"episode_id": self.episode_id, "calls": self.calls},
            }
            if len(kept) > 1:
                result.details["gateway"]["part"] = [number + 1, len(kept)]
            records.append((dataclasses.replace(self.prompt, ids=part.prompt_ids), result))
        return records


def parse_reward(body: Any) -> tuple[float, dict[str, Any]]:
    """The reward a close request reports: ``reward`` a finite number, or named finite
    components (summed); ``details`` an optional object kept in the record."""
    if not isinstance(body, dict):
        raise EpisodeRefused("the body must be a JSON object with 'reward'", 400)
    unknown = sorted(set(body) - {"reward", "details"})
    if unknown:
        raise EpisodeRefused(f"unknown field(s) {unknown}; expected 'reward' and 'details'", 400)
    reward = body.get("reward")
    details = body.get("details", {})
    if not isinstance(details, dict):
        raise EpisodeRefused("'details' must be an object", 400)
    if _is_number(reward):
        return float(reward), dict(details)
    if isinstance(reward, dict) and reward and all(_is_number(v) for v in reward.values()):
        components = {str(k)[:64]: float(v) for k, v in reward.items()}
        return math.fsum(components.values()), {**details, "rewards": components}
    raise EpisodeRefused(
        f"'reward' must be a finite number or an object of finite numbers, got {reward!r:.80}",
        400,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class CloseReceipt:
    """What a close did: the records the episode makes, and how many episodes of its
    group are still open (its records wait for them)."""

    records: int
    group_open: int


class EpisodeDesk:
    """Hands the worker's groups to agents, slot by slot, and tells it when they are done
    (the worker's ``Desk``)."""

    def __init__(
        self,
        config: GatewayConfig,
        limits: EpisodeLimits,
        metrics: ProducerMetrics,
        ledger: Ledger | None = None,
    ) -> None:
        self.config = config
        self.limits = limits
        self.metrics = metrics
        self.ledger = ledger  # where completed calls are committed
        # episodes earlier runs abandoned (a restart among the reasons), for their agents
        self._past = ledger.state.abandoned_episodes if ledger is not None else {}
        self._slots: deque[GatewayEpisode] = deque()
        self._slot_added = asyncio.Event()
        self._episodes: dict[str, GatewayEpisode] = {}
        self._finished: OrderedDict[str, GatewayEpisode] = OrderedDict()
        self._groups: dict[str, list[GatewayEpisode]] = {}
        self.stopping = False

    # --- the worker's side ---------------------------------------------------------------

    async def play(
        self, prompt: Prompt, group_id: str, size: int, stop: StopSignals
    ) -> GroupOutcome:
        """Offer a group of ``size`` episodes of ``prompt`` and wait until each is closed
        or abandoned. When the worker cancels what is in flight, the episodes still open
        are abandoned and the closed ones returned (``stopped``); none closed: ``Stopped``."""
        episodes = [
            GatewayEpisode(
                uuid.uuid4().hex, group_id, i, prompt, self.limits, self.config.history_mismatch
            )
            for i in range(size)
        ]
        for episode in episodes:
            self._episodes[episode.episode_id] = episode
        self._groups[group_id] = episodes
        self._slots.extend(episodes)
        self._slot_added.set()
        stopped = False
        try:
            while not all(e.done for e in episodes):
                if stop.cancelled.is_set():
                    stopped = True
                    break
                self._expire(episodes)
                pending = [asyncio.ensure_future(e.finished.wait()) for e in episodes if not e.done]
                pending.append(asyncio.ensure_future(stop.cancelled.wait()))
                _, waiting = await asyncio.wait(
                    pending, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                for future in waiting:
                    future.cancel()
        finally:
            for episode in episodes:
                self.abandon(episode, "stopped", "the producer stopped")  # only if still open
                self._forget(episode)
            self._groups.pop(group_id, None)
        closed = [e for e in episodes if e.state == "closed"]
        abandoned = {e.episode_id: e.reason for e in episodes if e.state == "abandoned"}
        if stopped and not closed:
            if self.ledger is not None:  # no outcome for the worker to write it from
                self.ledger.abandoned(group_id, abandoned)
            raise Stopped
        return GroupOutcome(
            [record for e in closed for record in e.records()],
            abandoned,
            closed,
            stopped,
        )

    @staticmethod
    def settle(outcome: GroupOutcome, fate: str) -> None:
        """What the worker did with a group's closed episodes (``GatewayEpisode.fate``)."""
        for episode in outcome.closed:
            episode.fate = fate

    def _expire(self, episodes: list[GatewayEpisode]) -> None:
        idle = self.config.idle_timeout_s
        now = time.monotonic()
        for episode in episodes:
            if episode.state == "open" and now - episode.created > idle:
                self.abandon(episode, "unclaimed", f"no agent opened it within {idle:g}s")
            elif (
                episode.state == "active"
                and not episode.busy
                and now - episode.last_activity > idle
            ):
                if episode.last_call is not None and episode.last_call.undelivered:
                    self.abandon(episode, "client_left", LEFT_BEFORE_ANSWER)
                else:
                    self.abandon(episode, "idle", f"no call or reward for {idle:g}s")

    def _forget(self, episode: GatewayEpisode) -> None:
        self._episodes.pop(episode.episode_id, None)
        with_slot = [e for e in self._slots if e is not episode]
        if len(with_slot) != len(self._slots):
            self._slots = deque(with_slot)
        self._finished[episode.episode_id] = episode
        while len(self._finished) > REMEMBERED_EPISODES:
            self._finished.popitem(last=False)

    # --- the agents' side ----------------------------------------------------------------

    async def claim(self) -> GatewayEpisode | None:
        """An open slot, waiting up to ``claim_wait_s`` for the worker to start a group;
        None when none came (admission holds new groups back) or the producer stops."""
        deadline = time.monotonic() + self.config.claim_wait_s
        while not self.stopping:
            while self._slots:
                episode = self._slots.popleft()
                if episode.state == "open":
                    episode.state = "active"
                    episode.last_activity = time.monotonic()
                    return episode
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._slot_added.clear()
            try:
                await asyncio.wait_for(self._slot_added.wait(), remaining)
            except TimeoutError:
                return None
        return None

    def episode(self, episode_id: str) -> GatewayEpisode:
        """The open episode ``episode_id``; refused when it is unknown or over."""
        episode = self.known(episode_id)
        episode.check_open()
        return episode

    def known(self, episode_id: str) -> GatewayEpisode:
        """The episode ``episode_id``, open or over (among the last remembered); 404
        when no agent opened it."""
        episode = self._episodes.get(episode_id) or self._finished.get(episode_id)
        if episode is None and episode_id in self._past:
            raise EpisodeEnded(episode_id, self._past[episode_id])
        if episode is None or episode.state == "open":  # a slot's id is known once claimed
            raise EpisodeRefused(f"no episode {episode_id!r} was opened here", 404)
        return episode

    async def commit_call(
        self, episode: GatewayEpisode, turn: PolicyTurn, prompt_tokens: int
    ) -> None:
        """Add a completed call to its (active) episode and commit it to the ledger, on
        disk (``ledger_fsync``) before the caller answers it."""
        episode.add_turn(turn)
        if self.ledger is None:
            return
        counts = CallCounts(episode.calls, prompt_tokens, len(turn.response_ids))
        self.ledger.episode_call(episode.group_id, episode.episode_id, counts, sync=False)
        await self.ledger.synced()  # shared with the calls committed beside it

    def close(
        self, episode: GatewayEpisode, reward: float, details: Mapping[str, Any]
    ) -> CloseReceipt:
        """Score the episode and end it; its records wait for the rest of its group."""
        episode.check_open()
        if episode.busy:
            raise EpisodeRefused("a call of this episode is still in flight")
        records = [p for p in episode.parts if p.policy_turns]
        if not records:
            self.abandon(episode, "no_call", "closed before any call")
            raise EpisodeRefused("the episode made no call: nothing to train on", 400)
        for part in records:
            part.result.reward = reward
            part.result.details = dict(details)
        episode.state = "closed"
        episode.finished.set()
        group = self._groups.get(episode.group_id, [])
        return CloseReceipt(len(records), sum(1 for e in group if not e.done))

    def abandon(self, episode: GatewayEpisode, kind: str, reason: str) -> None:
        """End an episode without a reward (never published); no-op once it is over."""
        if episode.done:
            return
        episode.state, episode.reason = "abandoned", reason
        episode.finished.set()
        self.metrics.gateway_abandoned.labels(reason=kind).inc()
