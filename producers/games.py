"""Multi-policy tasks: episodes in which two policies of one run play their parts.

``propose-solve`` (tiny model): a *proposer* is given a seed digit and writes a short
problem, a *solver* (a peer policy, its own engine and versions) copies the problem back.
Rewards depend on each other: the solver is scored on the problem the proposer wrote, and
the proposer on its problem's form and on how well the solver did with it. Both learn on
2 cores in a few minutes, and each policy's records go to its own trainer.

    proposer  prompt  BOS s SEP             -> problem  p1 .. pn EOS   (n = problem_digits)
    solver    prompt  BOS p1 .. pk SEP      -> answer   p1 .. pk EOS   (k <= n, the digits
                                                                        the proposer wrote)
    proposer reward = (form + solver score) / 2
        form: share of the checks "p1 is the seed s", "pi is a digit" (i = 2..n) and
        "EOS follows", so a problem is fully formed at n digits starting with s
    solver reward = its score on the problem (share of right positions of p1..pk EOS)

A proposer turn without a digit gets no solver turn (and the form score alone). The
solver's turns of one proposer group form one solver group: different problems of one
seed, so its advantages are centred on the group's mean across problems.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.models import BOS_ID, DIGIT0_ID, EOS_ID, SEP_ID
from producers.environments import EpisodeLimits, MalformedToolCall, Observation
from producers.peers import PeerEngine, Peers, PeerSample, PeerTurn
from producers.tasks import Prompt, TaskContext, digits_to_ids, register_task, score_digits


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
class ProposeSolveEpisode:
    seed: int
    problem_digits: int
    solver: PeerEngine
    solver_max_new_tokens: int
    form: float = 0.0
    problem: list[int] = field(default_factory=list)
    solver_turn: PeerTurn | None = None
    solver_score: float = 0.0
    solver_details: dict[str, Any] = field(default_factory=dict)

    async def step(self, turn_ids: list[int]) -> Observation:
        if self.solver_turn is not None:
            raise MalformedToolCall("propose-solve has one proposer turn")
        self.form = problem_form(self.seed, self.problem_digits, turn_ids)
        self.problem = problem_of(turn_ids, self.problem_digits)
        if self.problem:
            prompt = [BOS_ID, *digits_to_ids(self.problem), SEP_ID]
            self.solver_turn = await self.solver.generate(
                prompt,
                self.solver_max_new_tokens,
                [EOS_ID],
                rid=f"solve-{uuid.uuid4().hex}",
            )
            self.solver_score, self.solver_details = score_digits(
                self.problem, self.solver_turn.response_ids
            )
        return Observation(done=True)

    def reward(self) -> tuple[float, dict[str, Any]]:
        details = {
            "seed": self.seed,
            "problem": "".join(map(str, self.problem)),
            "form": self.form,
            "well_formed": self.form == 1.0,
            "solver_score": self.solver_score,
            "solved": bool(self.solver_details.get("correct", False)),
        }
        if self.solver_turn is not None:
            details["solver_version"] = self.solver_turn.version
        return (self.form + self.solver_score) / 2, details

    def peer_samples(self) -> list[PeerSample]:
        if self.solver_turn is None:
            return []
        details = {**self.solver_details, "seed": self.seed, "proposer_form": self.form}
        return [PeerSample(self.solver_turn, self.solver_score, details)]


@dataclass
class ProposeSolve:
    """The proposer's side of the game (the producer's own policy); the solver is a peer."""

    solver: PeerEngine
    problem_digits: int = 2
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
        )

    def encode(self, text: str) -> list[int]:
        raise MalformedToolCall("propose-solve answers with token ids, never text")

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> tuple[float, dict]:
        raise TypeError("propose-solve is scored per episode (Episode.reward)")


@register_task("propose-solve")
def propose_solve(
    context: TaskContext, solver: str = "solver", problem_digits: int = 2
) -> ProposeSolve:
    """``solver``: the peer policy that answers (``producers.rollout.peers`` must list it)."""
    if not 1 <= problem_digits <= 6:
        raise ValueError(f"propose-solve: problem_digits must be 1..6, got {problem_digits}")
    peers: Peers | None = context.peers
    if not peers or solver not in peers:
        raise ValueError(
            f"propose-solve needs the peer policy {solver!r}: run it in a multi-policy run "
            f"with producers.rollout.peers = [{solver!r}]"
        )
    return ProposeSolve(solver=peers[solver], problem_digits=problem_digits)
