"""Multi-policy tasks: episodes in which two policies of one run play their parts.

``propose-solve`` (tiny model): a *proposer* is given a seed digit and writes a short
problem, a *solver* (a peer policy, its own engine and versions) copies the problem back.
Rewards depend on each other: the solver is scored on the problem the proposer wrote, and
the proposer on its problem's form and on how well the solver did with it. Both learn on
2 cores in a few minutes, and each policy's records go to its own trainer.

    proposer  prompt  BOS s SEP             -> problem  p1 .. pn EOS   (n = problem_digits)
    solver    prompt  BOS p1 .. pk SEP      -> answer   p1 .. pk EOS   (k <= n, the digits
                                                                        the proposer wrote)
    proposer reward = (form + solver score if p1 = s, else 0) / 2
        form: share of the checks "p1 is the seed s", "pi is a digit" (i = 2..n) and
        "EOS follows", so a problem is fully formed at n digits starting with s; the
        solver's score counts only for a problem of the proposer's own seed, so one easy
        problem written for every seed does not pay
    solver reward = its score on the problem (share of right positions of p1..pk EOS)

A proposer turn without a digit gets no solver turn (and the form score alone). The
solver's turns of one proposer group form one solver group: different problems of one
seed, so its advantages are centred on the group's mean across problems.

With ``rounds = R`` > 1 an episode is multi-agent play: after each of the first R - 1
rounds the proposer sees the solver's answer (``p1 .. pk EOS SEP``) as a turn of the
solver (an environment turn to the proposer, named in the record's ``turn_policies``)
and writes its next problem; its reward is the mean over rounds.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.models import BOS_ID, DIGIT0_ID, EOS_ID, SEP_ID
from producers.tasks.base import Prompt, TaskContext, digits_to_ids, register_task, score_digits
from producers.tasks.environments import EpisodeLimits, MalformedToolCall, Observation
from producers.tasks.peers import PeerCall, PeerCalls, PeerSample, PeerTurn


def _is_digit(token: int) -> bool:
    return DIGIT0_ID <= token < DIGIT0_ID + 10


def problem_form(seed: int, problem_digits: int, turn_ids: Sequence[int]) -> float:
    """The share of form checks a proposer's turn passes (see the module doc)."""
    want = problem_digits + 1
    got = list(turn_ids[:want]) + [-1] * (want - min(len(turn_ids), want))
    checks = [got[0] == DIGIT0_ID + seed]
    checks += [_is_digit(t) for t in got[1:problem_digits]]
    checks.append(got[problem_digits] == EOS_ID)
    return sum(checks) / len(checks)


def problem_of(turn_ids: Sequence[int], problem_digits: int) -> list[int]:
    """The digits a proposer's turn wrote before anything else, at most ``problem_digits``."""
    digits = []
    for token in turn_ids[:problem_digits]:
        if not _is_digit(token):
            break
        digits.append(token - DIGIT0_ID)
    return digits


@dataclass
class Round:
    """One proposer turn and the solver's answer to it."""

    form: float
    problem: list[int]
    seeded: bool  # the problem starts with the seed digit
    solver_turn: PeerTurn | None = None
    solver_score: float = 0.0
    solver_details: dict[str, Any] = field(default_factory=dict)

    @property
    def reward(self) -> float:
        """Form, and the solver's score on a problem of this seed only: a proposer that
        wrote one easy problem for every seed would otherwise be paid for it."""
        return (self.form + (self.solver_score if self.seeded else 0.0)) / 2


@dataclass
class ProposeSolveEpisode:
    seed: int
    problem_digits: int
    solver: PeerCall
    solver_max_new_tokens: int
    rounds: int = 1
    played: list[Round] = field(default_factory=list)

    async def step(self, turn_ids: list[int]) -> Observation:
        if len(self.played) >= self.rounds:
            raise MalformedToolCall(f"propose-solve has {self.rounds} proposer turn(s)")
        problem = problem_of(turn_ids, self.problem_digits)
        now = Round(
            problem_form(self.seed, self.problem_digits, turn_ids),
            problem,
            seeded=bool(problem) and problem[0] == self.seed,
        )
        self.played.append(now)
        if now.problem:
            prompt = [BOS_ID, *digits_to_ids(now.problem), SEP_ID]
            now.solver_turn = await self.solver.generate(
                prompt,
                self.solver_max_new_tokens,
                [EOS_ID],
                rid=f"solve-{uuid.uuid4().hex}",
            )
            now.solver_score, now.solver_details = score_digits(
                now.problem, now.solver_turn.response_ids
            )
        if len(self.played) == self.rounds:
            return Observation(done=True)
        # the next round's proposer sees the solver's answer: a turn of the peer policy
        answer = list(now.solver_turn.response_ids) if now.solver_turn is not None else []
        return Observation(ids=[*answer, SEP_ID], policy=self.solver.policy)

    def reward(self) -> tuple[float, dict[str, Any]]:
        rounds = self.played or [Round(0.0, [], seeded=False)]
        details: dict[str, Any] = {
            "seed": self.seed,
            "problem": " ".join("".join(map(str, r.problem)) for r in rounds),
            "form": sum(r.form for r in rounds) / len(rounds),
            "well_formed": all(r.form == 1.0 for r in rounds),
            "seeded": all(r.seeded for r in rounds),
            "solver_score": sum(r.solver_score for r in rounds) / len(rounds),
            "solved": all(r.solver_details.get("correct", False) for r in rounds),
            "rounds_played": len(self.played),
        }
        versions = [r.solver_turn.version for r in rounds if r.solver_turn is not None]
        if versions:
            details["solver_version"] = max(versions)
        return sum(r.reward for r in rounds) / self.rounds, details

    def peer_samples(self) -> list[PeerSample]:
        return [
            PeerSample(
                r.solver_turn,
                r.solver_score,
                {**r.solver_details, "seed": self.seed, "proposer_form": r.form, "round": i},
            )
            for i, r in enumerate(self.played)
            if r.solver_turn is not None
        ]


@dataclass
class ProposeSolve:
    """The proposer's side of the game (the producer's own policy); the solver is a peer."""

    solver: PeerCall
    problem_digits: int = 2
    rounds: int = 1
    name: str = "propose-solve"
    stop_token_ids: list[int] = field(default_factory=lambda: [EOS_ID])
    limits: EpisodeLimits = field(
        default_factory=lambda: EpisodeLimits(
            max_turns=1, max_total_tokens=16, tool_timeout_s=120.0, max_observation_tokens=8
        )
    )

    @property
    def max_new_tokens(self) -> int:
        return self.problem_digits + 1

    def sample(self, rng: random.Random) -> Prompt:
        seed = rng.randrange(10)
        return Prompt([BOS_ID, DIGIT0_ID + seed, SEP_ID], {"seed": seed})

    def start(self, prompt: Prompt) -> ProposeSolveEpisode:
        return ProposeSolveEpisode(
            seed=int(prompt.meta["seed"]),
            problem_digits=self.problem_digits,
            solver=self.solver,
            solver_max_new_tokens=self.problem_digits + 1,
            rounds=self.rounds,
        )

    def encode(self, text: str) -> list[int]:
        raise MalformedToolCall("propose-solve answers with token ids, never text")

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict]:
        raise TypeError("propose-solve is scored per episode (Episode.reward)")


@register_task("propose-solve")
def propose_solve(
    context: TaskContext, solver: str = "solver", problem_digits: int = 2, rounds: int = 1
) -> ProposeSolve:
    """``solver``: the peer policy that answers (``producers.rollout.peers`` must list it);
    ``rounds``: proposer turns per episode, each after seeing the solver's last answer."""
    if not 1 <= problem_digits <= 6:
        raise ValueError(f"propose-solve: problem_digits must be 1..6, got {problem_digits}")
    if not 1 <= rounds <= 4:
        raise ValueError(f"propose-solve: rounds must be 1..4, got {rounds}")
    peers: PeerCalls | None = context.peers
    if not peers or solver not in peers:
        raise ValueError(
            f"propose-solve needs the peer policy {solver!r}: run it in a multi-policy run "
            f"with producers.rollout.peers = [{solver!r}]"
        )
    limits = EpisodeLimits(
        max_turns=rounds,
        max_total_tokens=rounds * (2 * problem_digits + 3),
        tool_timeout_s=120.0,
        max_observation_tokens=problem_digits + 2,
    )
    return ProposeSolve(
        solver=peers[solver], problem_digits=problem_digits, rounds=rounds, limits=limits
    )
